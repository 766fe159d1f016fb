"""Reports: sweeps on one machine (``sweep``), Pareto plots (``plots``), the paper's Table 2
layout (``table2``, ``paper``), per-sample parquet tables (``consolidate``) and paired
comparisons between runs (``compare``)."""
