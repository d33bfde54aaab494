"""Fine-tuning loop around deepspeed.initialize; DeepSpeed config rendering; reports."""
