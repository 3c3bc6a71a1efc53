"""Study file, factories and pool configuration: bad input gives a clear error naming the field."""

import re

import optuna
import pytest
import yaml

from hpdl.hpo.errors import HpoConfigError
from hpdl.hpo.pool import PoolSource, build_pool, gpu_kind
from hpdl.hpo.spec import StudySpec, make_pruner, make_sampler

BASE = {"study": "s", "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True},
                                "width": {"type": "categorical", "choices": [8, 16]},
                                "depth": {"type": "int", "low": 1, "high": 3}}}


def test_defaults_and_distributions(tmp_path):
    s = StudySpec.from_dict({**BASE, "run_dir": str(tmp_path)})
    assert s.direction == "maximize" and s.storage == f"sqlite:///{tmp_path.resolve() / 'study.db'}"
    d = s.distributions()
    assert isinstance(d["lr"], optuna.distributions.FloatDistribution) and d["lr"].log
    assert d["width"].choices == (8, 16) and d["depth"].high == 3
    assert StudySpec.from_dict({**BASE, "workload": "gpt", "space": {}}).direction == "minimize"


@pytest.mark.parametrize("bad,match", [
    ({"n_trials": 0}, "n_trials"),
    ({"direction": "up"}, "direction"),
    ({"space": {"lr": {"type": "beta"}}}, "space.lr.type"),
    ({"space": {"lr": {"type": "float", "low": 1}}}, "space.lr"),
    ({"space": {"nope": {"type": "int", "low": 1, "high": 2}}}, "unknown parameters"),
    ({"fixed": {"lr": 0.1}}, "both in space and fixed"),
    ({"colour": 1}, "unknown study file keys"),
    ({"workload": "resnet"}, "workload"),
    ({"n_trials": "six"}, r"n_trials='six', expected an int >= 1"),
    ({"max_retries": -1}, r"max_retries=-1, expected an int >= 0"),
    ({"timeout_s": -5}, r"timeout_s=-5, expected seconds >= 0"),
    ({"space": {"width": {"type": "categorical"}}}, r"space.width \(type categorical\) misses \['choices'\]"),
    ({"sampler": {"name": "grid"}, "n_trials": 5, "space": {"width": {"type": "categorical", "choices": [8, 16]}}},
     r"n_trials=5 with sampler grid: expected <= 2"),
])
def test_bad_spec_fields(bad, match):
    with pytest.raises(HpoConfigError, match=match):
        StudySpec.from_dict({**BASE, **bad})


def test_fake_pool_memory_must_be_positive():
    with pytest.raises(HpoConfigError, match=r"pool.memory_gb=-4, expected > 0"):
        build_pool({"fake": 2, "memory_gb": -4})


def test_yaml_roundtrip_and_missing_file(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({**BASE, "n_trials": 3}))
    assert StudySpec.from_yaml(p).n_trials == 3
    with pytest.raises(HpoConfigError, match="does not exist"):
        StudySpec.from_yaml(tmp_path / "missing.yaml")


def test_sampler_and_pruner_factories():
    assert isinstance(make_sampler({"name": "tpe", "seed": 1}, {}), optuna.samplers.TPESampler)
    assert isinstance(make_sampler({"name": "random"}, {}), optuna.samplers.RandomSampler)
    assert isinstance(make_sampler({"name": "grid"}, {"w": {"type": "categorical", "choices": [1, 2]}}),
                      optuna.samplers.GridSampler)
    assert isinstance(make_pruner({"name": "asha", "min_resource": 2}), optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(make_pruner({"name": "hyperband"}), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner({"name": "median"}), optuna.pruners.MedianPruner)
    with pytest.raises(HpoConfigError, match="grid"):
        make_sampler({"name": "grid"}, {"lr": {"type": "float", "low": 0, "high": 1}})
    with pytest.raises(HpoConfigError, match="sampler.name"):
        make_sampler({"name": "bayes"}, {})
    with pytest.raises(HpoConfigError, match="pruner.name"):
        make_pruner({"name": "early"})


def test_pool_forms_and_elastic_file(tmp_path):
    fake = build_pool({"fake": 3, "memory_gb": 2})
    assert [d.id for d in fake] == ["fake:0", "fake:1", "fake:2"] and fake[0].memory_bytes == 2 << 30
    devs = build_pool({"devices": [{"id": "a", "kind": "A100", "memory_gb": 40},
                                   {"id": "h", "kind": "H100", "memory_gb": 80}], "speeds": {"H100": 2.0}})
    assert [d.speed for d in devs] == [1.0, 2.0]
    assert gpu_kind("NVIDIA H200") == "H200" and gpu_kind("NVIDIA A100-SXM4-80GB") == "A100"
    with pytest.raises(HpoConfigError, match="duplicate"):
        build_pool({"devices": [{"id": "a", "memory_gb": 1}, {"id": "a", "memory_gb": 1}]})
    with pytest.raises(HpoConfigError, match="missing"):
        build_pool({"devices": [{"id": "a"}]})
    with pytest.raises(HpoConfigError, match=r"unknown keys \['tpu'\]"):
        build_pool({"tpu": 4})
    with pytest.raises(HpoConfigError, match=r"unknown keys \['memroy_gb'\]"):   # a typo is not ignored
        build_pool({"fake": 2, "memroy_gb": 4})
    f = tmp_path / "pool.yaml"
    f.write_text(yaml.safe_dump({"fake": 1}))
    src = PoolSource({"file": str(f)})
    assert len(src.devices()) == 1
    import os
    f.write_text(yaml.safe_dump({"fake": 2}))
    os.utime(f, ns=(1, 10**18))  # a new mtime even within the clock's resolution
    assert len(src.devices()) == 2
    f.write_text("fake: [unclosed")  # mid-edit garbage keeps the last good pool
    os.utime(f, ns=(1, 2 * 10**18))
    assert len(src.devices()) == 2


@pytest.mark.parametrize("over, match", [
    ({"warm_workers": True}, "warm_workers"),
    ({"policy": {"name": "pack", "max_trials_per_device": 1.5}}, "max_trials_per_device"),
    ({"policy": {"name": "pack", "max_compute": "2"}}, "max_compute"),
    ({"backend": {"name": "local", "adress": "x"}}, "unknown keys"),
    ({"mps": "yes"}, "mps='yes', expected false, true, auto or start"),
    ({"mps": "false"}, "unquoted"),
    ({"mps": 1}, "mps=1"),
    ({"mps": "start", "backend": {"name": "ray"}, "pool": {"ray": "all"}}, "mps: start .* backend"),
    ({"policy": {"name": "pack", "sm_caps": "no"}}, "sm_caps"),
    ({"policy": {"name": "pack", "memory_caps": "false"}}, "memory_caps"),
    ({"policy": {"name": "pack", "order": "fifo"}}, "order=.fifo., expected .memory. or .longest."),
    ({"policy": {"name": "pakc"}}, "policy='pakc'"),
    ({"policy": {"name": "pack", "max_compte": 2.0}}, "bad options"),
    ({"policy": {"name": "pack", "max_compute": -1}}, "max_compute=-1"),
    ({"sampler": {"name": "random", "sed": 1}}, "sampler 'random': bad options"),
    ({"pruner": {"name": "median", "n_warmup": 1}}, "pruner 'median': bad options"),
    ({"space": {"lr": {"type": "float", "low": 0.01, "high": 0.1, "lg": True}}}, r"space.lr has unknown keys \['lg'\]"),
])
def test_new_keys_are_type_checked(over, match):
    d = {"study": "s", "workload": "cnn", "n_trials": 2, "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
         "pool": {"fake": 1}}
    d.update(over)
    with pytest.raises(HpoConfigError, match=match):
        StudySpec.from_dict(d)


def test_policy_mps_of_older_study_files_moves_to_the_top_level():
    d = {"study": "s", "workload": "cnn", "n_trials": 2, "pool": {"fake": 1},
         "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "policy": {"name": "pack", "mps": True}}
    spec = StudySpec.from_dict(d)
    assert spec.mps is True and "mps" not in spec.policy and d["policy"]["mps"] is True


def test_attach_storage_opens_the_drivers_store_and_creates_nothing(tmp_path):
    """Trial processes open the store with ``attach=True``: they see the driver's study and trials, and on a
    path the driver never created they create no tables (the study load fails instead)."""
    import optuna

    from hpdl.hpo.spec import make_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=make_storage(url))
    study.enqueue_trial({"x": 1.0})
    attached = optuna.load_study(study_name="s", storage=make_storage(url, attach=True))
    assert [t.params for t in attached.get_trials()] == [{}] and len(attached.trials) == 1
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    with pytest.raises(Exception) as err:  # optuna wraps the SQL error in a StorageInternalError
        optuna.load_study(study_name="s", storage=make_storage(fresh, attach=True))
    assert "no such table" in f"{err.value} {err.value.__cause__}"


def test_timeout_nan_is_refused():
    # nan >= 0 is False, so a nan timeout never fired: the study ran with no limit
    with pytest.raises(HpoConfigError, match="timeout_s=nan"):
        StudySpec.from_dict({**BASE, "timeout_s": float("nan")})


@pytest.mark.parametrize("over, message", [
    ({"study": ""}, "study='', expected a non-empty name"),
    ({"study": 3}, "study=3, expected a non-empty name"),
    ({"n_trials": True}, "n_trials=True, expected an int >= 1"),  # YAML's true is no count
    ({"checkpoint_every": -1}, "checkpoint_every=-1, expected an int >= 0"),
    ({"lookahead": "3"}, "lookahead='3', expected an int >= 0"),
    ({"timeout_s": True}, "timeout_s=True, expected seconds >= 0"),
    ({"warm_workers": -1}, "warm_workers=-1, expected 'auto' or an int >= 0"),
    ({"run_dir": 5}, "run_dir=5, expected a folder"),
    ({"sampler": "tpe"}, "sampler='tpe', expected a mapping like {name: tpe, seed: 0}"),
    ({"space": [1]}, "space=[1], expected a mapping of name: {type: ...}"),
    ({"space": {"lr": 0.1}}, "space.lr: expected a mapping with 'type'"),
    ({"space": {"lr": {"type": "float", "low": "abc", "high": 1}}}, "space.lr.low='abc', expected a number"),
    ({"space": {"lr": {"type": "float", "low": 1, "high": 0.1}}}, "space.lr: ValueError: `low <= high`"),
    ({"policy": "pack"}, "policy='pack', expected a mapping with 'name'"),
    ({"policy": {"max_compute": 2}}, "policy: missing 'name', expected a mapping with 'name'"),
    ({"policy": {"name": "fixed_fraction", "fraction": True}}, "policy fraction=True, expected a number"),
    ({"policy": {"name": "pack", "starve_after_s": "10"}}, "policy starve_after_s='10', expected a number"),
    ({"backend": {"name": "slurm"}}, "backend={'name': 'slurm'}, expected {name: local} or {name: ray"),
    ({"backend": "ray"}, "backend='ray', expected {name: local}"),
    ({"pool": {"ray": "all"}}, "a {ray: all | N} pool goes with backend {name: ray}"),
    ({"backend": {"name": "ray"}}, "backend ray needs a ray pool"),
    ({"fuse": "yes"}, "fuse='yes', expected false, true or {max_trials: N"),
    ({"workload": "test_hpo_spec:StructuralFuse", "fuse": True}, "fuse_vary ['width'] are structural"),
    ({"n_trials": 0, "max_retries": -1}, "n_trials=0, expected an int >= 1 (and 1 more)"),
])
def test_every_check_names_the_field_and_the_expected_value(over, message):
    d = {"study": "s", "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "pool": {"fake": 1}, **over}
    with pytest.raises(HpoConfigError, match=re.escape(message)):
        StudySpec.from_dict(d)


class StructuralFuse(__import__("hpdl.hpo.workloads", fromlist=["VisionCNN"]).VisionCNN):
    name = "structural_fuse"
    fuse_vary = ("lr", "width")


def test_missing_study_and_a_top_level_that_is_no_mapping():
    with pytest.raises(HpoConfigError, match="study file: missing 'study'"):
        StudySpec.from_dict({"n_trials": 2})
    with pytest.raises(HpoConfigError, match="expected a mapping at the top level, got list"):
        StudySpec.from_dict([("study", "s")])


def test_json_input_and_types_kept_as_given(tmp_path):
    """A study given as JSON (what ``optimize`` and stored specs use) validates like YAML; nested mappings
    stay plain dicts with the values' own types (an int bound stays an int), and ``to_dict`` round-trips."""
    import json

    d = json.loads(json.dumps({**BASE, "run_dir": str(tmp_path), "policy": {"name": "pack", "max_compute": 2},
                               "backend": {"name": "local"}, "timeout_s": 5, "warm_workers": 0, "mps": False}))
    s = StudySpec.from_dict(d)
    assert s.space == BASE["space"] and type(s.space["depth"]["low"]) is int
    assert s.policy == {"name": "pack", "max_compute": 2} and type(s.policy["max_compute"]) is int
    assert s.backend == {"name": "local"} and s.timeout_s == 5 and s.warm_workers == 0 and s.mps is False
    assert StudySpec.from_dict(json.loads(json.dumps(s.to_dict()))).to_dict() == s.to_dict()
