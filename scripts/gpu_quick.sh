set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=$PWD/.torch-extensions CONTRASTIVE_TORCH_QUIET=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
t0=$SECONDS
(cd python && MAX_JOBS=14 python3 -c "import contrastive_torch as ct; ct.cuda_extension()" > $OUT/ext_cuda.txt 2>&1)
echo "cuda ext rc $? $((SECONDS-t0))s"
(cd python && MAX_JOBS=4 python3 -c "import contrastive_torch as ct; ct.extension()" > $OUT/ext_host.txt 2>&1) &
timeout 200 python3 scripts/gpu_side_by_side.py --budget 140 --n 16384 65536 --reps 5 --ours None chunked --contenders eager ours peers --out $OUT/side_by_side.md > $OUT/side.txt 2>&1
echo "side rc $? $((SECONDS-t0))s"
wait
(cd python && timeout 90 python3 -m pytest -q -p no:cacheprovider -rs -k "cuda or nccl" tests > $OUT/torch_tests.txt 2>&1)
echo "tests rc $? $((SECONDS-t0))s"; tail -3 $OUT/torch_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/torch_tests.txt | head
cat $OUT/side_by_side.md | grep -v "| skip |"
