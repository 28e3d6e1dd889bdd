"""The numbers the timing engine judges by, in a module of their own that imports nothing: the command line's
``--help`` texts quote them without loading torch."""

MIN_ROUNDS_FOR_VERDICT = 6      # below, even the min-max of the rounds covers their median less than 95%
SLOW_FACTOR = 10.0              # a contender this many times slower than the baseline on its first steps stops
SLOW_CONFIRMATIONS = 2          # ... and still on this many more steps of each side, in turn
NOISY_SPREAD = 1.5              # a "within noise" interval wider than this (high / low) is the machine's load
NOISE_FLOOR = 0.03              # step times closer than 3% are never told apart: two builds of the same plain model
                                #   in one process have read 1.01x (99.6% CI 1.00-1.02x) against each other
