"""Linear circuit of chip outputs, electrodes and tissue: time-domain state space and AC (phasor) analysis.

Nodes are the N electrode terminals (pins) followed by the tissue nodes. Each terminal sees its channel's
current source, a conductance to chip ground (the source's output resistance, the CMVH switch, or a fault
path) and its electrode branch. An electrode branch is ``R_s`` in series with ``R_ct || C_dl``; the
double-layer voltage ``v`` (drop from pin side to tissue side) is the state. With the state held, the
network is resistive, so terminal voltages and branch currents are affine in (source currents, states)::

    V_t = Z i + W v + V0          j = Ji i + Jv v + J0          dv/dt = As v + Bs [i; 1]

The state update uses the exact zero-order-hold discretisation (matrix exponential), so it is stable for any
step, however stiff the electrodes. The AC analysis solves the same network with complex branch admittances;
it is the independent oracle the impedance measurement is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import expm

from hpdl.tes.load import Electrode, Tissue


@dataclass
class StateSpace:
    """Discretised network for one parameter segment (all arrays float64, SI units).

    Shapes: N terminals/branches, C channels, S states (electrodes with ``C_dl > 0``).
    ``Z`` (N, C), ``W`` (N, S), ``V0`` (N,), ``Ji`` (N, C), ``Jv`` (N, S), ``J0`` (N,),
    ``Ad`` (S, S), ``Bd`` (S, C + 1) acting on ``[i; 1]``.
    """

    Z: np.ndarray
    W: np.ndarray
    V0: np.ndarray
    Ji: np.ndarray
    Jv: np.ndarray
    J0: np.ndarray
    Ad: np.ndarray
    Bd: np.ndarray


class Network:
    """Topology of one montage: electrodes, tissue, and which terminal each channel drives.

    Parameters
    ----------
    electrodes : list of Electrode, length N >= 2
    tissue : Tissue
    channel_terminal : sequence of int, length C
        Terminal (electrode index) each channel drives; each terminal at most once.

    Raises
    ------
    ValueError
        Fewer than two electrodes, or a channel index out of range or repeated.
    """

    def __init__(self, electrodes: list[Electrode], tissue: Tissue, channel_terminal):
        if len(electrodes) < 2:
            raise ValueError(f"a montage needs at least 2 electrodes, got {len(electrodes)}")
        self.electrodes = list(electrodes)
        self.tissue = tissue
        n = len(electrodes)
        ct = np.asarray(channel_terminal, dtype=np.int64).reshape(-1)
        if ct.size and (ct.min() < 0 or ct.max() >= n or len(set(ct.tolist())) != ct.size):
            raise ValueError(f"channel_terminal must be distinct indices in [0, {n}), got {ct.tolist()}")
        self.channel_terminal = ct
        self.lap, self.node_of = tissue.laplacian([e.name for e in electrodes])
        self.S = np.zeros((n, ct.size))
        self.S[ct, np.arange(ct.size)] = 1.0
        inc = np.zeros((n, n + self.lap.shape[0]))
        inc[np.arange(n), np.arange(n)] = 1.0
        inc[np.arange(n), n + self.node_of] = -1.0
        self.inc = inc

    @property
    def n_terminals(self) -> int:
        return len(self.electrodes)

    def _nodal(self, g_branch: np.ndarray, g_ground: np.ndarray) -> np.ndarray:
        n = self.n_terminals
        m = self.lap.shape[0]
        G = np.zeros((n + m, n + m), dtype=g_branch.dtype)
        G[np.arange(n), np.arange(n)] += g_ground
        G[n:, n:] += self.lap
        G += self.inc.T @ (g_branch[:, None] * self.inc)
        return G

    def state_space(self, t_s: float, g_ground: np.ndarray, inj_a: np.ndarray, dt_s: float) -> StateSpace:
        """Discretised model with electrode drift evaluated at ``t_s`` (s).

        Parameters
        ----------
        g_ground : (N,) float, S. Conductance from each terminal to chip ground (>= 0; some > 0).
        inj_a : (N,) float, A. Constant current injected into each terminal (a fault's Norton source).
        dt_s : float, step in s (> 0).

        Raises
        ------
        ValueError
            No terminal is connected to ground (the nodal matrix is singular).
        """
        if not dt_s > 0:
            raise ValueError(f"dt_s must be > 0, got {dt_s!r}")
        els = [e.at(t_s) for e in self.electrodes]
        n = self.n_terminals
        stateful = np.array([e.has_state for e in els])
        r_branch = np.array([e.r_s_ohm if e.has_state else e.r_s_ohm + e.r_ct_ohm for e in els])
        g = 1.0 / r_branch
        E = np.zeros((n, int(stateful.sum())))
        E[np.flatnonzero(stateful), np.arange(E.shape[1])] = 1.0
        g_ground = np.asarray(g_ground, float)
        if g_ground.shape != (n,) or np.any(g_ground < 0) or not np.any(g_ground > 0):
            # the tissue is connected (Tissue.laplacian checks), so one grounded pin makes G regular
            raise ValueError("the network has no path to chip ground: g_ground must be >= 0, shape (N,), "
                             "and > 0 on some terminal")
        G = self._nodal(g, g_ground)
        Ginv = np.linalg.inv(G)
        Gt = Ginv[:, :n]  # response of all nodes to terminal injections
        Vi = Gt @ self.S  # node voltages per unit channel current
        Vv = Ginv @ (self.inc.T @ (g[:, None] * E))
        V0n = Gt @ np.asarray(inj_a, float)
        Ji = g[:, None] * (self.inc @ Vi)
        Jv = g[:, None] * (self.inc @ Vv - E)
        J0 = g * (self.inc @ V0n)
        ns, nc = E.shape[1], self.S.shape[1]
        if ns:
            cdl = np.array([e.c_dl_f for e in els])[stateful]
            rct = np.array([e.r_ct_ohm for e in els])[stateful]
            As = (E.T @ Jv - np.diag(1.0 / rct)) / cdl[:, None]
            Bs = np.hstack([E.T @ Ji, (E.T @ J0)[:, None]]) / cdl[:, None]
            aug = np.zeros((ns + nc + 1, ns + nc + 1))
            aug[:ns, :ns] = As
            aug[:ns, ns:] = Bs
            phi = expm(aug * dt_s)
            Ad, Bd = phi[:ns, :ns], phi[:ns, ns:]
        else:
            Ad, Bd = np.zeros((0, 0)), np.zeros((0, nc + 1))
        return StateSpace(Vi[:n], Vv[:n], V0n[:n], Ji, Jv, J0, Ad, Bd)

    def ac(self, freq_hz: float, source_phasors_a: np.ndarray, g_ground: np.ndarray, t_s: float = 0.0):
        """Phasor solution at one frequency.

        Parameters
        ----------
        freq_hz : float, Hz (> 0).
        source_phasors_a : (C,) complex, A. Channel source currents (amplitude and phase).
        g_ground : (N,) float, S. As in :meth:`state_space`.
        t_s : float. Time at which electrode drift is evaluated.

        Returns
        -------
        v_terminal : (N,) complex, V.   j_branch : (N,) complex, A (current into each electrode).
        """
        els = [e.at(t_s) for e in self.electrodes]
        g = 1.0 / np.array([e.impedance(freq_hz) for e in els], dtype=np.complex128)
        G = self._nodal(g, np.asarray(g_ground, float).astype(np.complex128))
        rhs = np.zeros(G.shape[0], dtype=np.complex128)
        rhs[: self.n_terminals] = self.S @ np.asarray(source_phasors_a, dtype=np.complex128)
        V = np.linalg.solve(G, rhs)
        return V[: self.n_terminals], g * (self.inc @ V)
