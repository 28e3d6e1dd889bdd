"""The one timing engine: a step clock, contenders alternating in rounds, and the statistics of their
ratios. The trials of the auto-selector, the comm autotuner, ``aiak bench`` and ``aiak demo`` all time here."""
