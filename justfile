# memascend workflows. `just --list` shows every recipe.

set shell := ["bash", "-euo", "pipefail", "-c"]

python := env_var_or_default("PYTHON", "python3")

# Install memascend (runtime + test tools) into the current Python environment
install:
    ./install.sh --dev

# Run the default test suite (the README's test command, minus the install)
test *ARGS:
    {{python}} -m pytest {{ARGS}}

# Fine-tune with the built-in defaults (SmolLM2-135M on Shakespeare, params+optimizer on NVMe); extra flags pass through
finetune *ARGS:
    {{python}} -m memascend finetune {{ARGS}}

# Lint Python sources with ruff
lint-py:
    {{python}} -m ruff check memascend tests
