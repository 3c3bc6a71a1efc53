"""The study file (YAML) and the factories it names: search space, Optuna sampler, pruner, storage.

A study file (``hpdl hpo run study.yaml``; example in ``hpdl/hpo/examples/quick.yaml``)::

    study: quick            # Optuna study name
    workload: cnn           # cnn | gpt | package.module:WorkloadClass
    n_trials: 8             # budget: configurations that finish (complete or pruned)
    run_dir: hpo-runs/quick # checkpoints, profiles, worker logs; default hpo-runs/<study>
    storage: null           # SQLAlchemy URL; default sqlite:///<run_dir>/study.db (postgresql://... for many nodes)
    sampler: {name: tpe, seed: 0}          # tpe | random | grid | cmaes | qmc, plus keyword options
    pruner: {name: median, n_warmup_steps: 50}  # none | median | percentile | asha | hyperband | threshold
    space:                  # Optuna distributions
      lr: {type: float, low: 0.001, high: 0.3, log: true}
      width: {type: categorical, choices: [8, 16, 32]}
      depth: {type: int, low: 1, high: 3}
    fixed: {steps: 60, eval_every: 20}     # workload parameters that are not searched
    policy: {name: pack}    # one_per_gpu | fixed_fraction | pack | pack_hetero, plus options
    pool: {fake: 2}         # see hpdl.hpo.pool.build_pool
    max_retries: 2          # attempts after the first for a configuration whose process failed
    checkpoint_every: 1     # evaluations between checkpoints (0 = never)
    warm_workers: auto      # worker processes started per GPU before the clock starts (auto: the policy's
                            # concurrency per GPU, at most 8; none on fake CPU devices), or an int
    backend: {name: local}  # local (worker processes on this host) | ray (Ray tasks; address, init options)
    fuse: false             # true or {max_trials: 16, wait_s: 0.5}: train trials of one model shape K at a time
                            # as one fused model (hpdl.hpo.fusion; the workload must list fuse_vary)
    mps: auto               # NVIDIA MPS for co-located trials: auto (use a running daemon if one is found),
                            # start (a private daemon for this study, stopped at its end; local backend),
                            # true (a daemon runs: trust it), false (processes time-slice the GPU)
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError,
                      field_validator, model_validator)

from hpdl.hpo.errors import HpoConfigError

# a number that is not a bool (YAML's true would otherwise read as 1) and, when it bounds something, not NaN
_Number = StrictInt | StrictFloat
_Count = Annotated[StrictInt, Field(ge=0)]


class _Distribution(BaseModel):
    """One search-space entry (``space.<name>``): an Optuna distribution's arguments."""

    model_config = ConfigDict(extra="forbid")

    type: str
    low: StrictInt | float | None = None  # an int stays an int (int distributions), "0.1" reads as 0.1
    high: StrictInt | float | None = None
    log: bool = False
    step: StrictInt | float | None = None
    choices: list | None = None

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, d: Any, info) -> Any:
        name = (info.context or {}).get("name", "?")
        if not isinstance(d, dict) or "type" not in d:
            raise ValueError(f"space.{name}: expected a mapping with 'type' (float, int or categorical)")
        t = d["type"]
        if t not in ("float", "int", "categorical"):
            raise ValueError(f"space.{name}.type={t!r}, expected 'float', 'int' or 'categorical'")
        allowed = {"type", "choices"} if t == "categorical" else {"type", "low", "high", "log", "step"}
        required = {"choices"} if t == "categorical" else {"low", "high"}
        if required - set(d):
            raise ValueError(f"space.{name} (type {t}) misses {sorted(required - set(d))}")
        if set(d) - allowed:
            raise ValueError(f"space.{name} has unknown keys {sorted(set(d) - allowed)}, expected some of "
                             f"{sorted(allowed)}")
        return d


_DIST_EXPECTED = {"low": "a number", "high": "a number", "step": "a number", "log": "true or false",
                  "choices": "a list", "type": "'float', 'int' or 'categorical'"}


class _Policy(BaseModel):
    """The keys of ``policy`` checked here; the policy's other options are its constructor's (``get_policy``
    refuses an unknown one)."""

    model_config = ConfigDict(extra="allow")

    name: str
    sm_caps: StrictBool | None = None
    memory_caps: StrictBool | None = None
    max_compute: _Number | None = None
    fraction: _Number | None = None
    unprofiled_compute: _Number | None = None
    starve_after_s: _Number | None = None
    light_below: _Number | None = None
    max_trials_per_device: Annotated[StrictInt, Field(ge=1)] | None = None


class _Backend(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["local", "ray"] = "local"
    address: str | None = None
    init: dict | None = None
    strategy: str | None = None
    driver_host: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, d: Any) -> Any:
        if not isinstance(d, dict) or d.get("name", "local") not in ("local", "ray"):
            raise ValueError(f"backend={d!r}, expected {{name: local}} or {{name: ray, address: ...}}")
        name = d.get("name", "local")
        allowed = {"local": {"name"}, "ray": {"name", "address", "init", "strategy", "driver_host"}}[name]
        if set(d) - allowed:
            raise ValueError(f"backend has unknown keys {sorted(set(d) - allowed)}; allowed for {name!r}: "
                             f"{sorted(allowed)}")
        return d


# what a field expects, for the message of a value pydantic refused (``field=value, expected ...``)
_EXPECTED = {
    "study": "a non-empty name", "workload": "a name ('cnn', 'gpt') or 'module:Class'",
    "n_trials": "an int >= 1", "max_retries": "an int >= 0", "checkpoint_every": "an int >= 0",
    "lookahead": "an int >= 0", "timeout_s": "seconds >= 0 (0 or absent: no limit)",
    "run_dir": "a folder", "storage": "an SQLAlchemy URL",
    "direction": "'minimize' or 'maximize'", "warm_workers": "'auto' or an int >= 0",
    "mps": "false, true, auto or start (YAML booleans unquoted: mps: false)",
    "fuse": "false, true or {max_trials: N, wait_s: S, same_shape_asks: B}",
    "sampler": "a mapping like {name: tpe, seed: 0}", "pruner": "a mapping like {name: median}",
    "fixed": "a mapping of workload parameters", "space": "a mapping of name: {type: ...}",
    "pool": "a mapping (see hpdl.hpo.pool.build_pool)",
    "policy": "a mapping with 'name'", "policy name": "a policy name",
    "policy sm_caps": "true or false (unquoted)", "policy memory_caps": "true or false (unquoted)",
    "policy max_trials_per_device": "an int >= 1",
    **{f"policy {k}": "a number" for k in ("max_compute", "fraction", "unprofiled_compute", "starve_after_s",
                                          "light_below")},
}


class StudySpec(BaseModel):
    """A parsed, validated study file; every field documented in the module docstring.

    Validation is a pydantic model: each field's type and range first, then the checks that span fields
    or build what the driver will build (workload, policy, sampler, pruner), so a typo fails when the file
    is read, not mid-run. Unknown keys are errors.

    Raises:
        HpoConfigError: the first problem, as ``field=value, expected ...`` (``space.<name>``,
            ``policy <key>`` for nested keys), plus how many more there were.
    """

    model_config = ConfigDict(extra="forbid", validate_default=False)

    study: Annotated[str, Field(min_length=1, strict=True)]
    workload: Annotated[str, Field(strict=True)] = "cnn"
    n_trials: Annotated[StrictInt, Field(ge=1)] = 8
    run_dir: Annotated[str, Field(strict=True)] = ""
    storage: Annotated[str, Field(strict=True)] = ""
    direction: Literal["", "minimize", "maximize"] = ""
    sampler: dict = Field(default_factory=lambda: {"name": "tpe", "seed": 0})
    pruner: dict = Field(default_factory=lambda: {"name": "none"})
    space: dict[str, _Distribution] = Field(default_factory=dict)
    fixed: dict = Field(default_factory=dict)
    policy: _Policy = Field(default_factory=lambda: {"name": "pack"})
    pool: dict = Field(default_factory=lambda: {"fake": 2})
    max_retries: _Count = 2
    checkpoint_every: _Count = 1
    lookahead: _Count = 0
    timeout_s: Annotated[_Number, Field(ge=0)] | None = 0.0  # NaN fails ge: a NaN limit never fired
    warm_workers: Literal["auto"] | _Count = "auto"
    backend: _Backend = Field(default_factory=lambda: {"name": "local"})
    mps: StrictBool | Literal["auto", "start"] = "auto"
    fuse: StrictBool | dict | None = False

    # the nested mappings stay plain dicts (what the driver, the workers and the stored spec read): each
    # is validated by its model above, then kept as it was given
    @field_validator("space", mode="before")
    @classmethod
    def _space(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v  # pydantic names the type error
        out = {}
        for k, d in v.items():
            try:
                out[k] = _Distribution.model_validate(d, context={"name": k})
            except ValidationError as exc:
                err = exc.errors()[0]
                if err["type"] == "value_error":
                    raise ValueError(str(err["ctx"]["error"])) from None
                key = err["loc"][0]
                raise ValueError(f"space.{k}.{key}={err['input']!r}, expected "
                                 f"{_DIST_EXPECTED.get(key, err['msg'])}") from None
        return out

    @field_validator("space", mode="after")
    @classmethod
    def _space_dicts(cls, v: dict) -> dict:
        return {k: d.model_dump(exclude_unset=True) for k, d in v.items()}

    @field_validator("policy", "backend", mode="after")
    @classmethod
    def _dicts(cls, v: BaseModel) -> dict:
        return v.model_dump(exclude_unset=True)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, d: Any) -> Any:
        """``policy.mps``, where older study files had it: moved up to ``mps`` (the caller's dict unchanged)."""
        if isinstance(d, dict) and isinstance(d.get("policy"), dict) and "mps" in d["policy"]:
            old = d["policy"]["mps"]
            d = {**d, "policy": {k: v for k, v in d["policy"].items() if k != "mps"}}
            if d.get("mps", "auto") == "auto":
                d["mps"] = old
        return d

    @model_validator(mode="after")
    def _cross_check(self) -> "StudySpec":
        """Checks that span fields or build the workload, policy, sampler and pruner; fills the defaults
        that depend on other fields (run_dir, storage, direction)."""
        self.run_dir = self.run_dir or os.path.join("hpo-runs", self.study)
        self.storage = self.storage or f"sqlite:///{Path(self.run_dir).resolve() / 'study.db'}"
        from hpdl.hpo.workloads import get_workload
        w = get_workload(self.workload)
        self.direction = self.direction or w.direction
        if self.direction not in ("minimize", "maximize"):
            raise ValueError(f"direction={self.direction!r} (the workload's), expected 'minimize' or 'maximize'")
        backend = self.backend.get("name", "local")
        if self.mps == "start" and backend != "local":
            raise ValueError("mps: start runs a daemon on this host; it needs backend {name: local} "
                             "(on Ray, start MPS on each node and use mps: true)")
        if ("ray" in self.pool) != (backend == "ray"):
            raise ValueError(f"pool={self.pool!r} with backend={self.backend!r}: a {{ray: all | N}} pool "
                             "goes with backend {name: ray}, and backend ray needs a ray pool")
        from hpdl.hpo.grouping import FuseOptions
        if FuseOptions.parse(self.fuse) is not None and not w.fuse_vary:
            raise ValueError(f"fuse={self.fuse!r} with workload {self.workload!r}: the workload lists no "
                             "fuse_vary parameters, so it cannot be fused (docs/hpo.md, Fusing trials)")
        both = sorted(set(w.fuse_vary) & set(w.structural))
        if both:
            raise ValueError(f"workload {self.workload!r}: fuse_vary {both} are structural (they change a "
                             "shape); fused trials must share them")
        overlap = set(self.space) & set(self.fixed)
        if overlap:
            raise ValueError(f"parameters {sorted(overlap)} are both in space and fixed")
        w.resolve({**{k: None for k in self.space}, **self.fixed})  # unknown names raise here
        self.distributions()  # Optuna's own checks (low <= high, ...)
        from hpdl.hpo.policies import get_policy
        get_policy(self.policy["name"], **{k: v for k, v in self.policy.items() if k != "name"})
        import warnings
        with warnings.catch_warnings():  # the driver builds them again; warn there, once
            warnings.simplefilter("ignore")
            make_sampler(self.sampler, self.space)
            make_pruner(self.pruner)
        if (self.sampler or {}).get("name") == "grid":
            points = math.prod(len(d["choices"]) for d in self.space.values())
            if self.n_trials > points:  # Optuna's grid repeats points once every one was asked
                raise ValueError(f"n_trials={self.n_trials} with sampler grid: expected <= {points}, the "
                                 "number of grid points (the product of the space's choices)")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StudySpec":
        """Validate a study given as a mapping (parsed YAML or JSON, or built by the CLI or :func:`optimize`).

        Raises:
            HpoConfigError: see the class docstring.
        """
        if not isinstance(d, dict):
            raise HpoConfigError(f"study file: expected a mapping at the top level, got {type(d).__name__}")
        try:
            return cls.model_validate(d)
        except ValidationError as exc:
            raise HpoConfigError(_message(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "StudySpec":
        p = Path(path)
        if not p.is_file():
            raise HpoConfigError(f"study file {str(p)!r} does not exist")
        d = yaml.safe_load(p.read_text()) or {}
        if not isinstance(d, dict):
            raise HpoConfigError(f"study file {str(p)!r}: expected a mapping at the top level")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in type(self).model_fields}

    def distributions(self) -> dict[str, Any]:
        """The search space as ``{name: optuna.distributions.BaseDistribution}``.

        Raises:
            HpoConfigError: Optuna refuses the arguments (e.g. ``low > high``), naming ``space.<name>``.
        """
        return {name: _distribution(name, d) for name, d in self.space.items()}


def _message(exc: ValidationError) -> str:
    """The first of pydantic's errors in the house form: ``field=value, expected ...``; a check of ours
    (a ValueError) as it wrote itself; all unknown top-level keys together."""
    errors = exc.errors()
    extra = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1)
    if extra:
        return f"unknown study file keys {extra}, expected some of {sorted(StudySpec.model_fields)}"
    err = errors[0]
    fields = {e["loc"][0] if e["loc"] else "" for e in errors}  # one field's union members count once
    more = f" (and {len(fields) - 1} more)" if len(fields) > 1 else ""
    if err["type"] == "value_error":
        return str(err["ctx"]["error"]) + more
    loc = err["loc"]
    if loc == ("study",) and err["type"] == "missing":
        return "study file: missing 'study' (the study name)"
    # the field and, in policy, its key; the rest of a location names union members, not keys
    field = f"policy {loc[1]}" if loc[0] == "policy" and len(loc) > 1 and f"policy {loc[1]}" in _EXPECTED \
        else str(loc[0])
    if err["type"] == "missing":  # a required key of a nested mapping
        return f"{loc[0]}: missing {loc[-1]!r}, expected {_EXPECTED.get(str(loc[0]), 'that key')}" + more
    return f"{field}={err['input']!r}, expected {_EXPECTED.get(field, err['msg'])}" + more


def _distribution(name: str, d: dict):
    import optuna.distributions as od

    t = d["type"]
    try:
        if t == "float":
            return od.FloatDistribution(float(d["low"]), float(d["high"]), log=bool(d.get("log", False)),
                                        step=d.get("step"))
        if t == "int":
            return od.IntDistribution(int(d["low"]), int(d["high"]), log=bool(d.get("log", False)),
                                      step=int(d.get("step", 1)))
        return od.CategoricalDistribution(list(d["choices"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise HpoConfigError(f"space.{name}: {type(exc).__name__}: {exc}") from None


def make_sampler(cfg: dict, space: dict[str, Any]):
    """Optuna sampler from ``{"name": ..., **options}``; parallel-safe defaults (TPE uses constant_liar).

    Raises:
        HpoConfigError: unknown name, or grid over a non-categorical parameter.
    """
    import optuna

    cfg = dict(cfg or {"name": "tpe"})
    name = cfg.pop("name", "tpe")
    try:
        return _sampler(optuna, name, cfg, space)
    except TypeError as exc:
        raise HpoConfigError(f"sampler {name!r}: bad options {cfg}: {exc}") from None


def _sampler(optuna, name: str, cfg: dict, space: dict):
    if name == "tpe":
        cfg.setdefault("constant_liar", True)
        return optuna.samplers.TPESampler(**cfg)
    if name == "random":
        return optuna.samplers.RandomSampler(**cfg)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(**cfg)
    if name == "qmc":
        return optuna.samplers.QMCSampler(**cfg)
    if name == "grid":
        grid = {}
        for k, d in space.items():
            if d.get("type") != "categorical":
                raise HpoConfigError(f"sampler grid: space.{k} must be categorical (grid needs a finite list)")
            grid[k] = list(d["choices"])
        return optuna.samplers.GridSampler(grid, **cfg)
    raise HpoConfigError(f"sampler.name={name!r}, expected one of tpe, random, grid, cmaes, qmc")


def make_pruner(cfg: dict):
    """Optuna pruner from ``{"name": ..., **options}``: none, median, percentile, asha
    (SuccessiveHalvingPruner), hyperband, threshold (``lower``/``upper`` bounds on the reported value).

    Raises:
        HpoConfigError: unknown name.
    """
    import optuna

    cfg = dict(cfg or {"name": "none"})
    name = cfg.pop("name", "none")
    table = {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
             "percentile": optuna.pruners.PercentilePruner, "asha": optuna.pruners.SuccessiveHalvingPruner,
             "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
             "hyperband": optuna.pruners.HyperbandPruner, "threshold": optuna.pruners.ThresholdPruner}
    if name not in table:
        raise HpoConfigError(f"pruner.name={name!r}, expected one of {sorted(table)}")
    try:
        return table[name](**cfg)
    except TypeError as exc:
        raise HpoConfigError(f"pruner {name!r}: bad options {cfg}: {exc}") from None


def sqlite_path(url: str) -> Path | None:
    """The database file of a ``sqlite:///<path>`` URL; None for any other URL."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def make_storage(url: str, attach: bool = False):
    """An Optuna RDB storage for ``url`` (SQLite gets a 60 s lock timeout, write-ahead logging and its parent
    folder).

    Any SQLAlchemy URL works (``postgresql://user@host/db`` for many nodes). ``attach=True`` opens a store
    the driver already created (trial processes): no table creation, no schema-version check and no
    journal-mode switch. Measured on an H200 host, 8 warm workers per GPU: a worker's study load took
    0.64-0.74 s (median per run, 3 runs) against 0.65-1.47 s (40 runs, median 0.95 s) without.
    """
    import optuna

    kwargs: dict[str, Any] = {"skip_compatibility_check": True, "skip_table_creation": True} if attach else {}
    path = sqlite_path(url)
    if path is not None:
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    if path is not None and not attach:
        path.parent.mkdir(parents=True, exist_ok=True)
        # write-ahead log: many trial processes report while the driver writes, readers never block a writer
        import sqlite3
        with contextlib.closing(sqlite3.connect(path, timeout=60)) as con:
            con.execute("PRAGMA journal_mode=WAL")
    return optuna.storages.RDBStorage(url, **kwargs)
