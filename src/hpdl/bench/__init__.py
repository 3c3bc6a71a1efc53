"""hpdl.bench: one harness (sweep, timing, exact verification, tables, plots) plus per-collective specs."""
