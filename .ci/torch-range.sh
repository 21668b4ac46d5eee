#!/bin/bash
# Both ends of the torch range the chapters support (TESTED_TORCH in every train_llm.py), each in a venv of its
# own: the loss-parity tests of every chapter and the parity and resume tests of the chapters built on DTensor
# or pipelining. PyPI's Linux torch is the CUDA build (about 4 GB with its nvidia packages); it runs on a CPU.
#     bash .ci/torch-range.sh oldest|newest
set -euo pipefail
cd "$(dirname "$0")/.."

case "$1" in
    # What common GPU containers ship (and the project's GPU check machine has).
    oldest) torch=2.11.0 transformers=5.17.0 ;;
    # The newest torch release pip resolves today; transformers as pinned.
    newest) torch=2.15.0 transformers=5.24.0 ;;
    *) echo "usage: bash .ci/torch-range.sh oldest|newest" >&2; exit 2 ;;
esac

venv=/tmp/ci-venv-torch-$torch
python3 -m venv --clear "$venv"
# PIP_CONSTRAINT=/dev/null replaces a machine-wide constraint file that may cap torch below the newest release.
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install --quiet "torch==$torch" "transformers==$transformers" \
    $(grep -vE '^(#|torch==|transformers==)' requirements.txt)
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$venv/bin/python" -m pytest -p no:cacheprovider \
    tests/test_02_ddp.py::test_ddp_matches_single_process_on_the_global_batch \
    tests/test_04_fsdp.py tests/test_05_405b.py tests/test_06_tp.py tests/test_07_2d.py tests/test_08_pp.py \
    tests/test_09_3d.py tests/test_10_cp.py tests/test_11_ep.py tests/test_torch_range.py -k "match or relaunch or resume or torch_range or older"
