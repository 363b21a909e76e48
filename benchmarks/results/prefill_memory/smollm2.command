# three runs, one thread each, on a shared 2-core machine (load 5-7); each later run reuses the earlier's records (--reuse):
# 1. smollm2_oneforward_8k.json: 8k, chunked before generate trimmed the heap between chunks, and the one-forward runs
benchmarks/bench_prefill_memory.py --lengths 8192 16384 32768 --chunk 2048 --keep 0.1 --oneshot-at 8192=full,snapkv,h2o 16384=snapkv 32768= --full-chunked-max 8192 --out benchmarks/results/prefill_memory/smollm2_oneforward_8k.json   # stopped after 8k
# 2. smollm2_8k.json: 8k chunked with the heap trim, and the fixed-mmap-threshold variants
benchmarks/bench_prefill_memory.py --lengths 8192 16384 32768 --chunk 2048 --keep 0.1 --oneshot-at 8192=full,snapkv,h2o 16384= 32768= --full-chunked-max 8192 --mmap-at 8192=snapkv,h2o 32768=snapkv --reuse benchmarks/results/prefill_memory/smollm2_oneforward_8k.json --out benchmarks/results/prefill_memory/smollm2_8k.json   # stopped after 8k
# 3. smollm2.json: 16k and 32k
benchmarks/bench_prefill_memory.py --lengths 8192 16384 32768 --chunk 2048 --keep 0.1 --oneshot-at 8192=full,snapkv,h2o 16384= 32768= --chunked-at 16384=snapkv --full-chunked-max 8192 --mmap-at 8192=snapkv,h2o --reuse benchmarks/results/prefill_memory/smollm2_8k.json --out benchmarks/results/prefill_memory/smollm2.json
