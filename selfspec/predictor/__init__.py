"""The speedup predictor: measured costs (costs.py), acceptance replayed over teacher-forced
sequences (simulate.py), and the measurements of acceptance that feed it (calibrate.py)."""
