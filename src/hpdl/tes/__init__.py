"""hpdl.tes: executable behavioural model of an HD-TES stimulator SoC (seed 3).

Current DACs with mismatch and compliance, Randles electrode loads in a tissue network, temporal
interference (TI), common-mode voltage holding (CMVH), impedance measurement during tACS, and a
switched-capacitor over-current protection (OCP). See docs/tes.md.
"""

from hpdl.tes.channel import ChipClock, CurrentDac, DacParams, quantize
from hpdl.tes.cmvh import CmvhParams, calibrate, common_mode
from hpdl.tes.impedance import AdcParams
from hpdl.tes.load import Drift, Electrode, Tissue, randles_impedance
from hpdl.tes.ocp import OcpParams
from hpdl.tes.scenario import Fault, Scenario, SimResult, TiPair
from hpdl.tes.simulate import simulate
from hpdl.tes.ti import envelope, max_modulation, measure_envelope, modulation_along, modulation_depth

__all__ = [
    "AdcParams", "ChipClock", "CmvhParams", "CurrentDac", "DacParams", "Drift", "Electrode", "Fault", "OcpParams",
    "Scenario", "SimResult", "Tissue", "TiPair", "calibrate", "common_mode", "envelope", "max_modulation",
    "measure_envelope", "modulation_along", "modulation_depth", "quantize", "randles_impedance", "simulate",
]
