"""fp16 loss scaling: the scale and its overflow rule (`loss_scaler`), the factor at the root of every backward pass
(`root_scaling`), the script's own ``GradScaler`` (`script_scaler`), and the steps of optimizers aiak was not given
(`fp16_steps`)."""
