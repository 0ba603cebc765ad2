"""Side-by-side benchmarks: lightning-boost against plain Lightning, in one process, as ratios."""
