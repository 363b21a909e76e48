benchmarks/chunked_prefill_quality.py --length 2048 --samples 5 --methods snapkv inf_mllm --keeps 0.25 --chunk 512 --out benchmarks/results/prefill_memory/quality_smollm2.json
