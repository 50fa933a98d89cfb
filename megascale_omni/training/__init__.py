"""Training loop glue: megatron schedules, optimizer/LR, the Trainer."""
