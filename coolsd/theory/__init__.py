"""Theory lab: tabular AR models, exact statistics (the test oracle) and sampled statistics
through the production decoding code."""
from coolsd.theory.lab import exact_stats, sample_stats
from coolsd.theory.stats import chi_square_pvalue, total_variation
from coolsd.theory.tabular import TabularAR

__all__ = ["TabularAR", "exact_stats", "sample_stats", "chi_square_pvalue", "total_variation"]
