"""Electrode and tissue load: Randles electrodes (optionally drifting) joined by a tissue resistance network.

Randles circuit (Randles 1947; see models_tes.md section 3): a series resistance ``R_s`` followed by the
charge-transfer resistance ``R_ct`` in parallel with the double-layer capacitance ``C_dl``::

    Z(f) = R_s + R_ct / (1 + j 2 pi f R_ct C_dl)

``C_dl = 0`` makes the electrode a plain resistor ``R_s + R_ct`` (used for bench loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


def randles_impedance(freq_hz, r_s_ohm: float, r_ct_ohm: float, c_dl_f: float) -> np.ndarray:
    """Complex impedance in Ohm of a Randles circuit at ``freq_hz`` (scalar or array, Hz); same shape, complex128.

    >>> complex(randles_impedance(0.0, 1000.0, 5000.0, 1e-6))
    (6000+0j)
    """
    w = 2 * np.pi * np.asarray(freq_hz, dtype=np.float64)
    return r_s_ohm + r_ct_ohm / (1 + 1j * w * r_ct_ohm * c_dl_f)


@dataclass(frozen=True)
class Drift:
    """Exponential drift of an electrode's resistances: ``R(t) = R0 * (final + (1 - final) * exp(-t / tau))``.

    Models the fall of skin impedance after current onset (Hahn 2013 [unverified figure]). ``final_ratio``
    is the ratio reached for ``t >> tau_s``; ``C_dl`` is kept constant.
    """

    final_ratio: float = 1.0
    tau_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.final_ratio > 0:
            raise ValueError(f"Drift.final_ratio must be > 0, got {self.final_ratio!r}")
        if not self.tau_s > 0:
            raise ValueError(f"Drift.tau_s must be > 0, got {self.tau_s!r}")

    def factor(self, t_s: float) -> float:
        """Resistance multiplier at time ``t_s`` (s), in ``(0, inf)``; 1 at t = 0."""
        return self.final_ratio + (1.0 - self.final_ratio) * float(np.exp(-t_s / self.tau_s))


@dataclass(frozen=True)
class Electrode:
    """One electrode: Randles parameters (Ohm, Ohm, F), area (cm^2), position label and optional drift."""

    name: str
    r_s_ohm: float = 1000.0
    r_ct_ohm: float = 5000.0
    c_dl_f: float = 1e-6
    area_cm2: float = 1.0
    position: str = ""
    drift: Drift | None = None

    def __post_init__(self) -> None:
        if not self.r_s_ohm > 0:
            raise ValueError(f"electrode {self.name!r}: r_s_ohm must be > 0, got {self.r_s_ohm!r}")
        if self.r_ct_ohm < 0 or self.c_dl_f < 0:
            raise ValueError(f"electrode {self.name!r}: r_ct_ohm and c_dl_f must be >= 0")
        if self.c_dl_f > 0 and not self.r_ct_ohm > 0:
            raise ValueError(f"electrode {self.name!r}: c_dl_f > 0 needs r_ct_ohm > 0")
        if not self.area_cm2 > 0:
            raise ValueError(f"electrode {self.name!r}: area_cm2 must be > 0, got {self.area_cm2!r}")

    @property
    def has_state(self) -> bool:
        """True when the electrode has a double-layer capacitor (a state of the time-domain model)."""
        return self.c_dl_f > 0

    def at(self, t_s: float) -> "Electrode":
        """This electrode with its drift applied at time ``t_s`` (itself when it does not drift)."""
        if self.drift is None:
            return self
        k = self.drift.factor(t_s)
        return replace(self, r_s_ohm=self.r_s_ohm * k, r_ct_ohm=self.r_ct_ohm * k)

    def impedance(self, freq_hz) -> np.ndarray:
        """Complex impedance in Ohm at ``freq_hz`` (see :func:`randles_impedance`)."""
        return randles_impedance(freq_hz, self.r_s_ohm, self.r_ct_ohm, self.c_dl_f)


@dataclass(frozen=True)
class Tissue:
    """Tissue resistance network between the electrodes' inner nodes.

    ``model="star"``: every electrode's inner node connects to one body node through ``r_spread_ohm``
    (its spreading resistance). ``model="edges"``: ``edges`` lists ``(electrode_a, electrode_b, ohm)``
    resistors between inner nodes (each electrode must be reachable from every other one).
    """

    model: str = "star"
    r_spread_ohm: float = 300.0
    edges: tuple[tuple[str, str, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model not in ("star", "edges"):
            raise ValueError(f"Tissue.model must be 'star' or 'edges', got {self.model!r}")
        if self.model == "star" and not self.r_spread_ohm > 0:
            raise ValueError(f"Tissue.r_spread_ohm must be > 0, got {self.r_spread_ohm!r}")
        for a, b, r in self.edges:
            if not r > 0:
                raise ValueError(f"Tissue edge ({a!r}, {b!r}) needs a resistance > 0, got {r!r}")

    def laplacian(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Conductance Laplacian of the tissue nodes and the electrode-to-node map.

        Returns
        -------
        lap : (M, M) float64, S. M = n_electrodes + 1 for "star" (last node = body), n_electrodes for "edges".
        node_of : (n_electrodes,) int64, tissue node index of each electrode's inner end.

        Raises
        ------
        ValueError
            An edge names an unknown electrode, or the "edges" network is not connected.
        """
        n = len(names)
        if self.model == "star":
            lap = np.zeros((n + 1, n + 1))
            g = 1.0 / self.r_spread_ohm
            for e in range(n):
                lap[e, e] += g
                lap[n, n] += g
                lap[e, n] -= g
                lap[n, e] -= g
            return lap, np.arange(n)
        index = {name: i for i, name in enumerate(names)}
        lap = np.zeros((n, n))
        for a, b, r in self.edges:
            for x in (a, b):
                if x not in index:
                    raise ValueError(f"Tissue edge names unknown electrode {x!r}; known: {sorted(index)}")
            i, j, g = index[a], index[b], 1.0 / r
            lap[i, i] += g
            lap[j, j] += g
            lap[i, j] -= g
            lap[j, i] -= g
        # connected iff the Laplacian has exactly one zero eigenvalue
        if n > 1 and np.sum(np.linalg.eigvalsh(lap) < 1e-12 * max(1.0, np.abs(lap).max())) != 1:
            raise ValueError("Tissue edges must connect every electrode (the network has separate parts)")
        return lap, np.arange(n)
