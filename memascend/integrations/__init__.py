"""Integrations with training frameworks; :mod:`memascend.integrations.deepspeed` is the only one."""
