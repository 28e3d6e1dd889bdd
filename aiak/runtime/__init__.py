"""Process-wide and model-wide switches that change speed, not the math of a step: TF32, cuDNN autotuning, CPU
affinity, channels_last, ``torch.compile``; and the rollback that restores them when ``optimize()`` fails or a
trial ends."""
