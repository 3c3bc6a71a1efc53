"""Time-stepped simulation of the stimulator SoC driving a montage: DACs, compliance, CMVH, OCP, impedance.

One step (``dt = 1 / fs``) is: DAC source currents (codes -> mismatch, trims, noise) -> network solve for pin
voltages and electrode currents -> compliance (channels whose pin would pass +-V_c become voltage-limited,
their current solved so the pin sits at the rail) -> OCP -> exact ZOH update of the double-layer voltages.
Drift, faults and OCP trips rebuild the network matrices between steps. Impedance measurement and TI analysis
run afterwards on the recorded waveforms (the ADC does not load the circuit).
"""

from __future__ import annotations

import bisect
import math

import numpy as np
from scipy.signal import lfilter

from hpdl.tes.analysis import analyse_ti, common_mode_summary, measure_impedances
from hpdl.tes.channel import CurrentDac, quantize
from hpdl.tes.cmvh import calibrate
from hpdl.tes.network import Network
from hpdl.tes.ocp import Ocp
from hpdl.tes.scenario import Scenario, SimResult, ground_paths


def _clip(i_req, rest, zc, vc, enabled):
    """Compliance: currents when some pins would pass the rails +-vc. Returns (currents, limited mask).

    A limited stage holds its pin at the rail: at +vc it sources at most its request but can sink any
    current (output device and clamp to the supply), mirrored at -vc; a stage latched off by the OCP is
    disconnected. With the deficit ``x = i_req - i`` and the pin voltages ``V = V_req - Z x`` these are the
    optimality conditions of the convex problem ``min 1/2 x'Zx - V_req'x + vc |x|_1`` (Z, the pins' transfer
    impedance, is symmetric positive definite), solved by an active set: add pins over a rail, drop pins
    whose deficit has the wrong sign, re-solve, until both conditions hold.
    """
    v_req = zc @ i_req + rest
    side = np.zeros(i_req.size)  # +1 / -1: pin held at +vc / -vc; 0: free
    x = np.zeros(i_req.size)
    for _ in range(4 * i_req.size + 4):
        v = v_req - zc @ x
        over = enabled & (side == 0) & (np.abs(v) > vc * (1 + 1e-12))
        wrong = (side != 0) & (side * x < 0)
        if not (over.any() or wrong.any()):
            break
        side[over] = np.sign(v[over])
        side[wrong] = 0.0
        held = side != 0
        x[:] = 0.0
        if held.any():
            x[held] = np.linalg.solve(zc[np.ix_(held, held)], v_req[held] - vc * side[held])
    return i_req - x, side != 0


_CHUNK = 4096  # samples per vectorised chunk


class _Recorder:
    def __init__(self, k: int, n: int, c: int):
        self.i = np.empty((k, c))
        self.out = np.empty((k, 2 * n))
        self.clip = np.zeros((k, c), dtype=bool)
        self.en = np.empty((k, c), dtype=bool)


class _Stepper:
    """Advances the circuit. ``fast_chunk`` solves a stretch with no compliance or OCP activity in one
    vectorised pass (modal decomposition of the state matrix + ``scipy.signal.lfilter``); otherwise
    ``step_range`` steps one sample at a time with the active-set compliance solve and the OCP."""

    def __init__(self, sc: Scenario, net: Network, ocp: Ocp, ct: np.ndarray, dt: float):
        self.sc, self.net, self.ocp, self.ct, self.dt = sc, net, ocp, ct, dt
        self.n, self.c = net.n_terminals, ct.size
        self.enabled = np.ones(self.c, dtype=bool)
        self.v = None
        self.dirty = True

    def build(self, t_s: float) -> None:
        g, inj = ground_paths(self.sc, self.enabled, t_s)
        m = self.net.state_space(t_s, g, inj, self.dt)
        # stages that regulate (compliance applies): enabled and not failed (a fault bypasses the stage)
        failed = np.zeros(self.c, dtype=bool)
        for f in self.sc.faults:
            failed[f.channel] |= f.t_start_s <= t_s < f.t_end_s
        self.regulated = self.enabled & ~failed
        self.ct_reg = self.ct[self.regulated]
        ns = m.Ad.shape[0]
        if self.v is None:
            self.v = np.zeros(ns)
        self.m_out = np.vstack([np.hstack([m.Z, m.V0[:, None], m.W]), np.hstack([m.Ji, m.J0[:, None], m.Jv])])
        self.m_st = np.hstack([m.Bd, m.Ad])
        self.Bd, self.Ad = m.Bd, m.Ad
        self.zc, self.wc = m.Z[self.ct], np.hstack([m.V0[:, None], m.W])[self.ct]
        self.modal = None
        if ns:
            lam, P = np.linalg.eig(m.Ad)
            if np.all(np.abs(lam.imag) < 1e-12) and np.linalg.cond(P) < 1e8:
                P = P.real
                self.modal = (lam.real, P, np.linalg.inv(P))
        self.dirty = False

    def fast_chunk(self, k0: int, k1: int, t, i_src, rec: _Recorder) -> bool:
        ns = self.v.size
        i = i_src[k0:k1] * self.enabled
        u = np.hstack([i, np.ones((k1 - k0, 1))])
        if ns:
            if self.modal is None:
                return False
            lam, P, Pinv = self.modal
            drive = (u @ self.Bd.T) @ Pinv.T
            z0 = Pinv @ self.v
            z_next = np.empty_like(drive)
            for j in range(ns):
                z_next[:, j] = lfilter([1.0], [1.0, -lam[j]], drive[:, j], zi=[lam[j] * z0[j]])[0]
            v_next = z_next @ P.T
            v_prev = np.vstack([self.v[None, :], v_next[:-1]])
        else:
            v_next = v_prev = np.zeros((k1 - k0, 0))
        out0 = np.hstack([u, v_prev]) @ self.m_out.T
        vc = self.sc.dac.compliance_v
        if np.abs(out0[:, self.ct_reg]).max(initial=0.0) > vc:
            return False
        if not self.ocp.quiet(np.abs(out0[:, self.n + self.ct]).max()):
            return False
        self.ocp.skip(t[k1 - 1] + self.dt, np.abs(out0[-1, self.n + self.ct]))
        rec.out[k0:k1] = np.hstack([u, 0.5 * (v_prev + v_next)]) @ self.m_out.T
        rec.i[k0:k1] = i
        rec.en[k0:k1] = self.enabled
        if ns:
            self.v = v_next[-1].copy()
        return True

    def step_range(self, k0: int, k1: int, t, i_src, rec: _Recorder) -> int:
        """Step from k0 towards k1; returns the index where it stopped (early when the OCP trips)."""
        c, vc = self.c, self.sc.dac.compliance_v
        u = np.empty(c + 1 + self.v.size)
        u[c] = 1.0
        for k in range(k0, k1):
            i = i_src[k] * self.enabled
            u[:c] = i
            u[c + 1:] = self.v
            out = self.m_out @ u
            if np.abs(out[self.ct_reg]).max(initial=0.0) > vc:
                i, rec.clip[k] = _clip(i, self.wc @ u[c:], self.zc, vc, self.regulated)
                u[:c] = i
                out = self.m_out @ u
            rec.i[k] = i
            rec.en[k] = self.enabled
            v_next = self.m_st @ u
            # record at mid-step (trapezoidal state), where a held current's fundamental is centred
            u[c + 1:] = 0.5 * (self.v + v_next)
            rec.out[k] = self.m_out @ u
            self.v = v_next
            tripped = self.ocp.step(t[k], self.dt, out[self.n + self.ct])
            if tripped.any():
                self.enabled = self.enabled & ~tripped
                self.dirty = True
                return k + 1
        return k1


def simulate(sc: Scenario, *, progress=None) -> SimResult:
    """Run ``sc`` and return the recorded waveforms, OCP events, impedance log, TI and common-mode summaries.

    >>> from hpdl.tes import Electrode, Tissue
    >>> from hpdl.tes.waveforms import Sine
    >>> sc = Scenario([Electrode("E1"), Electrode("REF")], ["ch"], [0], [Sine(amplitude_a=1e-3, freq_hz=100.0)],
    ...               duration_s=0.2, fs_hz=20e3, reference=1)
    >>> res = simulate(sc)
    >>> row = res.impedance_log[-1]
    >>> bool(abs(row["error_pct"]) < 1.0), bool(res.clipped.any())
    (True, False)

    Parameters
    ----------
    sc : Scenario (validated here).
    progress : optional callable ``progress(done_fraction)`` called about 50 times.

    Raises
    ------
    ValueError
        The scenario is inconsistent (see :meth:`Scenario.validate`).
    """
    sc.validate()
    ss_seed = np.random.SeedSequence(sc.seed)
    rng_mis, rng_noise, rng_adc, rng_ocp = (np.random.default_rng(s) for s in ss_seed.spawn(4))
    n, c = len(sc.electrodes), len(sc.channels)
    ct = np.asarray(sc.channel_terminal, dtype=np.int64)
    chips = sc.channel_chip or [0] * c
    k_steps = int(round(sc.duration_s * sc.fs_hz))
    dt = 1.0 / sc.fs_hz
    t = np.arange(k_steps) * dt

    dac = CurrentDac(c, sc.dac, rng_mis)
    cal = calibrate(dac, sc.cmvh, sc.adc, rng_adc) if sc.cmvh.calibrate else None
    dac.rng = rng_noise
    t_chip = np.stack([sc.clocks[chips[ch]].chip_time(t) for ch in range(c)], axis=1)
    i_target = np.stack([sc.waveforms[ch](t_chip[:, ch], sc.duration_s) for ch in range(c)], axis=1)
    codes = quantize(i_target, sc.dac)
    i_src = dac.output(codes)

    net = Network(sc.electrodes, sc.tissue, ct)
    rebuild = {0}
    if any(e.drift is not None for e in sc.electrodes):
        step = max(1, int(round(sc.drift_update_s * sc.fs_hz)))
        rebuild.update(range(0, k_steps, step))
    for f in sc.faults:
        for te in (f.t_start_s, f.t_end_s):
            if math.isfinite(te) and 0 <= te < sc.duration_s:
                rebuild.add(int(math.ceil(te * sc.fs_hz - 1e-9)))
    rebuild_at = sorted(rebuild) + [k_steps]
    ocp = Ocp(c, sc.ocp, rng_ocp)
    rec = _Recorder(k_steps, n, c)
    stepper = _Stepper(sc, net, ocp, ct, dt)
    k, every_done = 0, 0.0
    while k < k_steps:
        if stepper.dirty or k in rebuild:
            stepper.build(t[k])
        k_end = min(rebuild_at[bisect.bisect_right(rebuild_at, k)], k + _CHUNK)
        if not stepper.fast_chunk(k, k_end, t, i_src, rec):
            k_end = stepper.step_range(k, k_end, t, i_src, rec)
        k = k_end
        if progress is not None and k / k_steps >= every_done:
            progress(k / k_steps)
            every_done += 0.02

    res = SimResult(sc, t, codes, i_target, rec.i, rec.out[:, n:], rec.out[:, :n], rec.clip, rec.en,
                    list(ocp.events), cal, dac)

    res.impedance_log = measure_impedances(res, net, t_chip, rng_adc)
    res.ti = analyse_ti(res, t_chip)
    res.common_mode = common_mode_summary(res)
    return res
