#!/usr/bin/env bash
# GPU checks for the CUDA-graph decode work, one device call: build, kernel tests, a step. Logs go to $1.
# usage: bash bench/gpu_graph_checks.sh OUTDIR [kernels] [bench] [graph-tests] [guards-memory] [regress] [parity]
#        [ar-gap] [host] [pdl] [serve] [fused] [gemv] [parity-gemv] [variants] [variants-pdl] [parity-all]
#        [kernel-bench] [kernel-bench-nopdl] [profile] [flags] [pdl-late] [pdl-default] [pdl-quick] [lamport]
#        [lamport-tp2] [solo] [ab] [overlap] [tune] [allreduce] [ar-pieces] [ar-tests] [ar-exact] [engine-tests]
#        [full-bench] [all-gpu-tests] [all-gpu-tests-parallel] [wide-m] [attn-prefetch] [attn-sweep] [boundary]
#        [argmax] [l2-carry] [acceptance] [prefill] [prefill-sizes] [structured]
#        [read-ceiling] [polled] [polled-ab] [polled-attn] [polled-attn-debug] [polled-attn-32] [shared-ar]
#        [shared-tp2] [shared-engine] [teardown] [engine-steps-ab] [api-servers] [parity-archs] [qwen3-norms]
# A step whose commands all exit 0 is marked "ok", else "FAILED"; the script exits 1 if any step failed, and 2 at
# once (before the build) for a step name it does not know.
# The device call brings back at most 8 files and nothing from a call that runs past its limit: every file goes to a
# work folder, and after each step the whole of it is packed into OUTDIR/results.tgz beside OUTDIR/summary.log (the
# console output so far), so a step that hangs still leaves every earlier step's results.
# NPROC (default 2): the ranks of every torchrun and of the tuner, and the world size of the all-reduce exactness
# tests, e.g. NPROC=4 bash bench/gpu_graph_checks.sh OUT ar-exact tune allreduce full-bench serve on four GPUs.
set -uo pipefail
# NVLink multicast stays off on shared machines whatever this shell inherited (session 38 found none of these set in
# a device command's environment): a multicast object can take the host's GPUs out of service for a day
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TPGRAPH_DISABLE_MULTICAST=1
NPROC=${NPROC:-2}
export TPGRAPH_GPU_TEST_WORLD_SIZE=$NPROC
dest=${1:?outdir}; shift
# every step name checked before the build: a typo would otherwise match no case below and pass as done
known=" $(sed -n 's/^    \([a-z0-9|-]*\)).*/\1/p' "$0" | tr '|\n' '  ') "
for step in "$@"; do
  case $known in *" $step "*) ;; *) echo "unknown step: '$step' (the steps are the case labels in $0)" >&2; exit 2 ;; esac
done
mkdir -p "$dest"
out=$(mktemp -d /tmp/gpc.XXXX)
pack() { tar czf "$dest/results.tgz" -C "$out" . 2>/dev/null; }
# the HTTP server's own dependencies (fastapi, uvicorn, ...; httpx2: the front ends' Responses API relay), from the
# carried wheelhouse where missing
need_server() { python3 -c "import fastapi, uvicorn, prometheus_client, httpx2" 2>/dev/null || { [ -d wheelhouse ] \
    && python3 -m pip install -q --no-index --find-links wheelhouse fastapi uvicorn jinja2 pydantic prometheus-client \
    httpx2; }; }
# xgrammar (structured outputs) from the carried wheelhouse where it is missing; -U: pydantic there needs a newer
# typing-extensions than the image may hold, which a plain install leaves as it is
need_xgrammar() { python3 -c "import xgrammar" 2>/dev/null || { [ -d wheelhouse ] && python3 -m pip install -q -U \
    --no-index --no-deps --find-links wheelhouse xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types \
    typing-inspection typing-extensions; } || true; }
exec > >(tee -a "$dest/summary.log") 2>&1
# bash does not wait for a process substitution: at exit, close our end of the pipe and let tee drain it into
# summary.log (else the last lines, the ok/FAILED summary, could be missing when the caller reads OUTDIR). Bounded: a
# step's leftover process holding the pipe would keep tee from ending, and a call past its limit brings back nothing.
log_pid=$!
trap 'exec >&- 2>&-; timeout 10 tail -s 0.05 --pid="$log_pid" -f /dev/null >/dev/null 2>&1' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
[ -n "${TPG_SKIP_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -v -e . > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import tpgraph._C as c; print(c.build_info())"
failed=""
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in  # the custom all-reduce needs two ranks or more: these steps cannot run at NPROC=1
    tune|allreduce|ar-exact|ar-tests|lamport-tp2) if [ "$NPROC" -lt 2 ]; then echo "$step needs NPROC >= 2: skipped"
      continue; fi ;;
  esac
  step_ok=1
  trap 'step_ok=0' ERR  # any command of the step (a pipeline: any of its parts, pipefail) exiting non-zero
  case $step in
    lamport) timeout 300 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -k cuda 2>&1 | tail -6 \
             | tee "$out/lamport_tests.log"
             timeout 300 python3 bench/bench_lamport.py --out "$out/lamport.json" 2>&1 | tail -8 \
             | tee "$out/lamport_bench.log" ;;
    lamport-tp2) # the all-reduce in the row-parallel projection's epilogue on NPROC GPUs (opt-in until this has run):
         # its exactness test, HF parity with it on, then the decode step with and without it (and with the late trigger),
         # interleaved, and the profile
         # (its limits add up past one call's 600 s: run it as the call's one step; each command's results are packed)
         timeout 400 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rs -k epilogue 2>&1 | tail -6 \
             | tee "$out/lamport_tp2_tests.log"; pack
         for dt in bf16 fp32; do TPGRAPH_GEMV_ALLREDUCE=1 timeout 200 torchrun --nproc-per-node $NPROC bench/hf_parity.py \
             --dtype $dt $([ $dt = bf16 ] && echo --embed-std 4.0) --out "$out/hf_parity_push_$dt.json" 2>&1 \
             | grep -E "prompt|PASS|Error" | tee -a "$out/hf_parity_push.log"; pack; done  # (fp32: the path declines)
         timeout 300 torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8,32 --no-ladders \
             --allreduce custom+gemv+overlap,custom+gemv+push+overlap,custom+gemv+push+late+overlap,nccl+gemv+overlap \
             --interleave --steps 100 \
             --out "$out/decode_push.json" \
             2>&1 | grep -E "TPOT|Error|error" | tee "$out/bench_push.log"; pack
         timeout -k 5 300 torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8 --no-ladders \
             --allreduce custom+gemv,custom+gemv+push,custom+gemv+push+late --profile --steps 20 \
             --out "$out/profile_push.json" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -60 | tee "$out/profile_push.log" ;;
    shared-engine) # TPEngine at TP=2 on ONE GPU (TPGRAPH_SHARED_GPU=1): started ranks and torchrun's, two starts in
         # one process each, the custom all-reduce set up, TP=1's tokens (tests/gpu/test_engine_tp_gpu.py)
         TPGRAPH_SHARED_GPU=1 timeout 560 python3 -m pytest tests/gpu/test_engine_tp_gpu.py -q -rfEs --durations=5 \
             > "$out/shared_engine.log" 2>&1  # (whole: a failure's reason is in the middle, under torchrun's)
         grep -E "Error|passed|failed|skipped" "$out/shared_engine.log" | grep -v "^E *File" | tail -30 ;;
    shared-ar|shared-tp2) # TP=2 on ONE GPU (TPGRAPH_SHARED_GPU=1: both ranks on GPU 0, tpgraph.distributed.shared_gpu),
         # for correctness only: the ranks' contexts take the GPU in turns, so nothing here is a timing. Two steps, a
         # call each (their limits add to 460 and 450 s). shared-ar: CUDA IPC between the ranks and the custom
         # all-reduce tests, the zero-copy graph test left out (its NCCL references go over loopback sockets, 64 MB
         # each, and outlast a call); 5 of them took 60 s and 9 others 88 s (session 31). shared-tp2: HF parity at
         # TP=2 with the default chain and with the all-reduce in the projections' epilogue (graphs on; about 55 s
         # each), then the graph-decode tests (115 s).
         export TPGRAPH_SHARED_GPU=1
         if [ "$step" = shared-ar ]; then
           timeout 60 python3 -m pytest tests/gpu/test_extension_gpu.py -q -rs 2>&1 | tail -4 | tee "$out/shared_ext.log"
           # (the whole log kept, -rfs naming every failure: session 55's 30-line tail lost one failure's name)
           timeout 400 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rfs --durations=20 \
               -k "not graphs_zero_copy" > "$out/shared_ar.log" 2>&1
           grep -E "^FAILED|^ERROR|passed|failed" "$out/shared_ar.log" | tail -20
         else
           for v in "bf16 0" "fp32 0" "bf16 1"; do set -- $v
             TPGRAPH_GEMV_ALLREDUCE=$2 timeout 100 torchrun --nproc-per-node 2 bench/hf_parity.py --dtype $1 \
                 $([ $1 = bf16 ] && echo --embed-std 4.0) --out "$out/shared_parity_$1_push$2.json" 2>&1 \
                 | grep -E "prompt|PASS|Error" | tee -a "$out/shared_parity.log"; pack; done
           timeout 150 python3 -m pytest tests/gpu/test_graph_decode_gpu.py -q -rs --durations=10 2>&1 | tail -8 \
               | tee "$out/shared_graph_decode.log"
         fi
         unset TPGRAPH_SHARED_GPU ;;
    ab) # whole steps of package trees / settings / tile tables, alternating processes (bench/ab_decode.py; prepare
         # the trees before the call: python bench/ab_decode.py --prepare REV ab/rev). AB_VARIANTS: its --variant (and
         # --tiles, --args) arguments, e.g. "--variant new=. --variant old=ab/head" (split unquoted: write --args
         # b32=--block-size=32, with no spaces); AB_ROUNDS (2), AB_ENTRY
         # (custom+gemv+overlap), AB_CONTEXT (512), AB_BATCHES (1,8,32), SHAPE as for overlap
         timeout 560 python3 bench/ab_decode.py --out "$out/ab" --nproc $NPROC --rounds "${AB_ROUNDS:-2}" \
             ${AB_VARIANTS:?set AB_VARIANTS to the --variant arguments} -- --shape "${SHAPE:-llama3-8b}" --modes full \
             --batches "${AB_BATCHES:-1,8,32}" --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" \
             --context "${AB_CONTEXT:-512}" --steps 100 2>&1 | grep -E "^==|^\||left out|Error" | tee "$out/ab.log" ;;
    solo) # TP=1 (NPROC=1): the residual add + the norm's staging in o_proj's and down's epilogue (a solo channel,
         # the TP=1 default since session 12, forced on here): the kernel tests (ws 1-3 on this GPU), HF parity with
         # it on, then decode steps with it off and on, interleaved (SHAPE as for overlap), and the profile of both.
         # (At NPROC=1 a plain custom+gemv entry in the other steps now times this chain too.)
         timeout 300 python3 -m pytest tests/unit/test_lamport_gemv.py -q -rs -k cuda 2>&1 | tail -4 \
             | tee "$out/solo_tests.log"
         for dt in bf16 fp32; do TPGRAPH_GEMV_ALLREDUCE=1 timeout 200 torchrun --nproc-per-node $NPROC bench/hf_parity.py \
             --dtype $dt $([ $dt = bf16 ] && echo --embed-std 4.0) --out "$out/hf_parity_solo_$dt.json" 2>&1 \
             | grep -E "prompt|PASS" | tee -a "$out/hf_parity_solo.log"; done  # (fp32: the path declines, unfused)
         timeout 400 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" --modes full \
             --batches 1,8,32 --no-ladders --allreduce custom+gemv+nopush+overlap,custom+gemv+push+overlap \
             --interleave --steps 100 --out "$out/decode_solo.json" 2>&1 | grep -E "TPOT|Error|error" \
             | tee "$out/bench_solo.log"
         timeout -k 5 300 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" \
             --modes full --batches 1,8 --no-ladders --allreduce custom+gemv+nopush,custom+gemv+push --profile \
             --steps 20 --out "$out/profile_solo.json" 2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -60 \
             | tee "$out/profile_solo.log" ;;
    overlap) # overlapped scheduling: its GPU tests, then decode steps driven plainly and overlapped, interleaved
         # (SHAPE: bench_decode's --shape; llama3-8b-half is a TP=2 rank's share, for one GPU)
         timeout 300 python3 -m pytest tests/gpu/test_buffers_gpu.py tests/gpu/test_engine_gpu.py -q -rs 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -8 | tee "$out/overlap_tests.log"
         timeout 400 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" --modes full \
             --batches 1,8,32 --no-ladders --allreduce custom+gemv,custom+gemv+overlap --interleave --steps 100 \
             --out "$out/decode_overlap.json" 2>&1 | grep -E "TPOT|Error|error" | tee "$out/bench_overlap.log" ;;
    kernels) timeout 300 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_argmax_gpu.py -q -x -rs 2>&1 \
             | tail -25 | tee "$out/kernels.log" ;;
    bench) timeout 400 torchrun --nproc-per-node $NPROC bench/bench_decode.py --batches 1,8 --modes full,none \
             --allreduce custom --steps 20 --no-ladders --profile --out "$out/decode_quick.json" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -40 | tee "$out/bench_quick.log" ;;
    graph-tests) timeout 560 python3 -m pytest tests/gpu/test_graph_decode_gpu.py -x -q -s -rs 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -60 | tee "$out/graph_tests.log" ;;
    all-gpu-tests) timeout 580 python3 -m pytest tests/gpu -q -rs 2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" \
             | tail -60 | tee "$out/gpu_tests.log" ;;
    all-gpu-tests-parallel) # every GPU test, as all-gpu-tests (which a call's limit cuts): the kernel tests (most of
         # them, and the slow ones) over 12 pytest workers, then at NPROC=1 the other files one test at a time (they
         # start ranks of their own; on two GPUs their two-rank tests need a call of their own). All 346 under -n 8 in
         # one run took 5 min 20 s on one H200 (session 28); in this form at -n 8 (session 30) the limit stopped the
         # kernel file with 357 of 363 passed and 1 skipped: 3 last-split attention cases still running and 2 never
         # started, queued behind busy workers. Hence 12 workers on the device's 16 cores, and work stealing so
         # that no case waits behind another worker's queue. pytest-xdist, where the device lacks it (it reaches no
         # index), comes from the carried wheelhouse (bench/make_wheelhouse.sh). Its timeouts (500 s) leave a 600 s
         # call room for the build only: run it as the call's one step.
         python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --find-links wheelhouse \
           pytest-xdist execnet 2>&1 | tail -2  # (without them pytest refuses -n)
         timeout -s INT -k 10 380 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -n 12 --dist worksteal -v \
             -rfEs --durations=10 -p no:cacheprovider > "$out/gpu_tests_kernels.log" 2>&1
         grep -v "PASSED\|it/s\]\|Warning\|warner" "$out/gpu_tests_kernels.log" | tail -25; pack
         if [ "$NPROC" -lt 2 ]; then
           timeout -s INT -k 10 120 python3 -m pytest tests/gpu -q -rfEs --ignore tests/gpu/test_fused_kernels_gpu.py \
               2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -30 | tee "$out/gpu_tests_other.log"
         else  # their two-rank tests take longer than the call has left
           echo "the other GPU test files: run ar-exact, graph-tests and engine-tests in a call of their own"
         fi ;;
    guards-memory) timeout 240 python3 -m pytest tests/gpu/test_graph_decode_gpu.py -x -q -s -rs -k "guards or memory" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -40 | tee "$out/guards_memory.log" ;;
    regress) timeout 200 python3 -m pytest tests/gpu -q -rs -k "not full_piecewise_breakable" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -30 | tee "$out/gpu_tests.log" ;;
    parity) timeout 150 torchrun --nproc-per-node $NPROC bench/hf_parity.py --embed-std 4.0 --out "$out/hf_parity_bf16.json" \
             2>&1 | grep -E "prompt|PASS" | tee "$out/hf_parity.log"
            timeout 120 torchrun --nproc-per-node $NPROC bench/hf_parity.py --dtype fp32 --out "$out/hf_parity_fp32.json" \
             2>&1 | grep -E "prompt|PASS" | tee -a "$out/hf_parity.log" ;;
    parity-archs) # HF parity of Qwen2.5-1.5B's shape (random q, k, v biases: the qkv + rope kernel adds them) and
         # Qwen3-1.7B's (q and k normed per head), 4 layers, bf16 and fp32, at NPROC ranks (about a minute each: the
         # four limits, with the build, stay within one call's 600 s)
         for arch in qwen2 qwen3; do for dt in bf16 fp32; do timeout 120 torchrun --nproc-per-node $NPROC \
             bench/hf_parity.py --arch $arch --dtype $dt $([ $dt = bf16 ] && echo --embed-std 4.0) \
             --out "$out/hf_parity_${arch}_$dt.json" 2>&1 | grep -E "prompt|PASS" | sed "s/^/$arch $dt: /" \
             | tee -a "$out/hf_parity_archs.log"; pack; done; done ;;
    qwen3-norms) # Qwen3's head norms in the qkv + rope kernel and in rope_and_store: their GPU tests and the Qwen3
         # checkpoint against transformers under graphs (parity-archs then runs HF parity of its shape)
         timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_biased_models_gpu.py -q -rfEs \
             -k "head or rope_and_store or qwen3" 2>&1 | tail -8 | tee "$out/qwen3_tests.log" ;;
    ar-gap) timeout 150 torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8,32 --steps 60 \
             --no-ladders --out "$out/decode_full.json" 2>&1 | grep -E "TPOT" | tee "$out/bench_full.log" ;;
    host) timeout 200 torchrun --nproc-per-node $NPROC bench/decode_host_breakdown.py --out "$out/host_breakdown.json" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" > "$out/host_breakdown.log"; grep -E "write=" "$out/host_breakdown.log" \
             || tail -20 "$out/host_breakdown.log" ;;
    pdl) TPGRAPH_TRITON_PDL=1 timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "norm" 2>&1 \
             | tail -5 | tee "$out/pdl_kernels.log"
         TPGRAPH_TRITON_PDL=1 timeout 300 python3 -m pytest tests/gpu/test_graph_decode_gpu.py -x -q -rs \
             -k full_piecewise_breakable 2>&1 | tail -5 | tee -a "$out/pdl_kernels.log"
         for pdl in 0 1 0 1; do TPGRAPH_TRITON_PDL=$pdl timeout 150 torchrun --nproc-per-node $NPROC bench/bench_decode.py \
             --modes full --batches 1,8,32 --no-ladders --out "$out/decode_pdl$pdl.json" 2>&1 | grep -E "TPOT" \
             | sed "s/^/pdl=$pdl /" | tee -a "$out/bench_pdl.log"; done ;;
    serve) # the server on the GPU: loaded streaming runs at each of SERVE_CONCURRENCY (default 64,1) through it
         # (needs fastapi + uvicorn there); SERVE_FLAGS adds server flags, e.g. --no-overlap-scheduling; SERVE_SHARED
         # gives every request a common system prompt of that many characters (prefix caching computes it once);
         # SERVE_SCORE_BATCH adds scoring runs of that many prompts a request (echo + logprobs, nothing generated)
         need_server
         need_xgrammar
         mkdir -p "$out/llama3_8b" && python3 -c "import json, sys; json.dump({'architectures': ['LlamaForCausalLM'],
             'model_type': 'llama', 'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336,
             'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, 'rms_norm_eps': 1e-5,
             'rope_theta': 500000.0, 'max_position_embeddings': 8192, 'torch_dtype': 'bfloat16',
             'bos_token_id': 128000, 'eos_token_id': 128001},
             open(sys.argv[1], 'w'))" "$out/llama3_8b/config.json"
         tag=${SERVE_TAG:-serve}
         timeout 500 torchrun --nproc-per-node $NPROC -m tpgraph.serve --model "$out/llama3_8b" --load-format dummy \
             --served-model-name llama3-8b --max-num-seqs 64 --max-model-len 1024 --port 8000 ${SERVE_FLAGS:-} \
             > "$out/$tag.log" 2>&1 &
         server=$!  # (timeout's pid: a TERM to it reaches torchrun, which ends its ranks)
         for _ in $(seq 240); do curl -sf localhost:8000/health >/dev/null && break; sleep 1; done
         curl -sf localhost:8000/health >/dev/null || { echo "server not up"; tail -30 "$out/$tag.log"; }
         timeout 400 python3 bench/bench_serve.py --model llama3-8b --concurrency "${SERVE_CONCURRENCY:-64,1}" \
             --max-tokens ${SERVE_TOKENS:-256} --prompt-len 256 --shared-prefix-len ${SERVE_SHARED:-0} \
             --score-batch ${SERVE_SCORE_BATCH:-0} --out "$out/$tag.json" 2>&1 | tee "$out/bench_$tag.log"
         # this step's server only (a pattern matched any tpgraph.serve on the host), waited for (5 s of sleep let a
         # slow shutdown hold the port and the GPU into the next step)
         kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; tail -5 "$out/$tag.log" ;;
    prefill) # time to first token through the engine (bench_prefill.py, TP=1, SHAPE as for ab): the SDPA loop and
         # varlen FlashAttention, each point's first sight beside its warm runs; then shared-prefix points with prefix
         # caching on and off; then rope_and_store at prefill sizes, one token a program against 16
         for v in 0 1; do TPGRAPH_VARLEN_PREFILL=$v timeout 200 python3 bench/bench_prefill.py --shape "${SHAPE:-llama3-8b}" \
             --no-prefix-caching --points 1x256,4x256,32x256,1x1024,1x4096,1x300,1x301,1x517 \
             --out "$out/prefill_varlen$v.json" 2>&1 | tr '\r' '\n' | grep -E " x +[0-9]+|Error" \
             | sed "s/^/varlen=$v /" | tee -a "$out/prefill.log"; pack; done
         for caching in on off; do timeout 200 python3 bench/bench_prefill.py --shape "${SHAPE:-llama3-8b}" \
             $([ $caching = off ] && echo --no-prefix-caching) --points 32x256+2048,8x64+4096,1x256+4096 \
             --out "$out/prefill_shared_caching_$caching.json" 2>&1 | tr '\r' '\n' | grep -E " x +[0-9]+|Error" \
             | sed "s/^/prefix caching $caching: /" | tee -a "$out/prefill.log"; pack; done
         timeout 200 python3 bench/bench_kernels.py --batches 1 --contexts 512 --prefill-tokens 256,1024,8192 \
             --out "$out/kernels_rope.json" 2>&1 | grep -E "rope|HBM|Error" | tee -a "$out/prefill.log" ;;
    prefill-sizes) # piecewise prefill capture sizes past 512 (session 43's default), with the start-up timing that
         # runs eagerly where padding costs more (the default) and without it, against sizes to 512 only, in one
         # call: time to first token at points around and past 512 tokens, and what each engine's graphs took (the
         # capture line: measured against the pool estimate, which the KV budget subtracts)
         for sizes in default uncalibrated 16,32,64,128,256,512; do timeout 150 python3 bench/bench_prefill.py \
             --shape "${SHAPE:-llama3-8b}" --no-prefix-caching --points 1x512,1x517,1x600,1x700,1x900,1x1024,2x300,4x256 \
             $(case $sizes in default) ;; uncalibrated) echo --no-prefill-calibration ;; *) echo --prefill-sizes $sizes ;; esac) \
             --out "$out/prefill_sizes_${sizes//,/_}.json" 2>&1 \
             | tr '\r' '\n' | grep -E " x +[0-9]+|Error|Graph capture|KV budget|prefill graphs timed" \
             | sed "s/^/[$sizes] /" | tee -a "$out/prefill_sizes.log"
             pack; done ;;
    fused) # 1shot_push + add + RMSNorm: kernel tests, then TPOT with it off and on (twice each), custom and NCCL
         timeout 300 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rs -k fused 2>&1 | tail -5 | tee "$out/fused_kernels.log"
         for f in 0 1 0 1; do TPGRAPH_FUSED_AR_NORM=$f timeout 150 torchrun --nproc-per-node $NPROC bench/bench_decode.py \
             --modes full --batches 1,8,32 --no-ladders --out "$out/decode_fused$f.json" 2>&1 | grep -E "TPOT" \
             | sed "s/^/fused=$f /" | tee -a "$out/bench_fused.log"; done ;;
    gemv) # the small-M projection kernel: GPU tests, the config sweep (its best per shape becomes the table), bandwidth
          # against cuBLAS with that table, then TPOT with it off and on
         timeout 300 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -x -k small_m 2>&1 | tail -3 \
             | tee "$out/gemv_tests.log"
         timeout 420 python3 bench/bench_gemv.py --sweep --sweep-ms 1,8 --out "$out/gemv_sweep.json" 2>&1 \
             | grep -v "it/s\]\|s/it\]" | tail -40 | tee "$out/gemv_sweep.log"
         export TPGRAPH_GEMV_TABLE="$out/gemv_sweep.json"
         timeout 200 python3 bench/bench_gemv.py --out "$out/gemv.json" 2>&1 | tail -30 | tee "$out/gemv.log"
         # every fused piece beside its plain version, in one run: cuBLAS or Triton projections, fused or two-kernel
         # all-reduce + RMSNorm, NCCL
         timeout 300 torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8,32 --no-ladders \
             --allreduce custom,custom+gemv,nccl --unfused --out "$out/decode_variants.json" 2>&1 | grep -E "TPOT" \
             | tee "$out/bench_variants.log"
         unset TPGRAPH_GEMV_TABLE ;;
    parity-gemv) # HF parity with the small-M projection kernel on (decode rows and short prompts take it)
         for dt in bf16 fp32; do TPGRAPH_GEMV=1 timeout 150 torchrun --nproc-per-node $NPROC bench/hf_parity.py --dtype $dt \
             $([ $dt = bf16 ] && echo --embed-std 4.0) --out "$out/hf_parity_gemv_$dt.json" 2>&1 | grep -E "prompt|PASS" \
             | tee -a "$out/hf_parity_gemv.log"; done ;;
    parity-all) # HF parity with every new path on: small-M kernels, SiLU·mul and qkv+rope fused, in-kernel reductions, PDL
         # (the defaults, set here in case the environment turns one off), the all-reduce in the projections' epilogue,
         # the fused argmax, and 32-row small-M tiles (TPGRAPH_GEMV_MAX_M=32, the default since session 15), at 3 and at 24 rows a step
         # (--copies 8)
         for copies in 1 8; do for dt in bf16 fp32; do TPGRAPH_GEMV=1 TPGRAPH_LAST_SPLIT_REDUCES=1 TPGRAPH_TRITON_PDL=1 \
             TPGRAPH_GEMV_ALLREDUCE=1 TPGRAPH_FUSED_ARGMAX=1 TPGRAPH_GEMV_MAX_M=32 \
             timeout 130 torchrun --nproc-per-node $NPROC bench/hf_parity.py --dtype $dt --copies $copies \
             $([ $dt = bf16 ] && echo --embed-std 4.0) --out "$out/hf_parity_all_${dt}_x$copies.json" 2>&1 \
             | grep -E "identical=False|PASS|Error" | sed "s/^/$dt x$copies /" | tee -a "$out/hf_parity_all.log"; pack
         done; done ;;
    variants) # every fused piece beside its plain version, in one run (the shipped GEMV table), interleaved
         # (+overlap: steps driven as the engine drives them; custom+gemv beside it shows what overlap gives); SHAPE as
         # for overlap
         timeout 420 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" --modes full \
             --batches 1,8,32 --no-ladders \
             --allreduce custom+overlap,custom+gemv+overlap,nccl+gemv+overlap,custom+gemv --unfused --interleave \
             --steps 100 \
             --out "$out/decode_variants.json" \
             2>&1 | grep -E "TPOT|Error|error" | tee "$out/bench_variants.log"
         [ -f "$out/decode_variants.json" ] && python3 bench/report_decode.py "$out/decode_variants.json" \
             $([ -f "$out/kernels.json" ] && echo --kernels "$out/kernels.json") | tee "$out/decode_report.md" ;;
    variants-pdl) # the same variants with the Triton kernels launched as programmatic dependents (GEMV weights
         # prefetched into L2 before the wait) and split kernels reduced in their last program, once each way (the
         # bench interleaves its entries); kernel bit-equality with each first
         TPGRAPH_TRITON_PDL=1 timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs \
             -k "small_m or norm or qkv_rope" \
             2>&1 | tail -3 | tee "$out/pdl_tests.log"
         # the PTX checks with this machine's Triton (ordering of the last-arriving reductions, rope's own products)
         timeout 200 python3 -m pytest tests/unit/test_gemv_kernel.py tests/unit/test_decode_attention.py -q -rs \
             -k "sm90 or pdl_variant" 2>&1 | tail -3 | tee -a "$out/pdl_tests.log"
         TPGRAPH_LAST_SPLIT_REDUCES=1 timeout 200 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs \
             -k "small_m or split_kv or qkv_rope" 2>&1 | tail -3 | tee -a "$out/pdl_tests.log"
         # graph decode = eager tokens with every new path on (small-M kernel, PDL + prefetch, in-kernel reductions)
         TPGRAPH_GEMV=1 TPGRAPH_TRITON_PDL=1 TPGRAPH_LAST_SPLIT_REDUCES=1 timeout 300 python3 -m pytest \
             tests/gpu/test_graph_decode_gpu.py -x -q -rs -k full_piecewise_breakable 2>&1 | tail -3 \
             | tee -a "$out/pdl_tests.log"
         for pdl in 0 1; do TPGRAPH_LAST_SPLIT_REDUCES=$pdl TPGRAPH_TRITON_PDL=$pdl timeout 200 torchrun --nproc-per-node $NPROC bench/bench_decode.py \
             --modes full --batches 1,8,32 --no-ladders --allreduce custom,custom+gemv --unfused --interleave \
             --steps 100 --out "$out/decode_variants_pdl$pdl.json" 2>&1 | grep -E "TPOT" | sed "s/^/pdl=$pdl /" \
             | tee -a "$out/bench_variants_pdl.log"; done ;;
    pdl-quick) # issue 11 in one short call: TPOT with the Triton kernels as programmatic dependents + in-kernel split
         # reductions off and on (bs 1, 8), then bf16 HF parity with every new path on, unfiltered (a teardown hung once)
         for pdl in 0 1; do TPGRAPH_LAST_SPLIT_REDUCES=$pdl TPGRAPH_TRITON_PDL=$pdl timeout -k 5 120 torchrun \
             --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8 --no-ladders \
             --allreduce custom,custom+gemv --interleave --steps 60 --out "$out/decode_pdl$pdl.json" 2>&1 \
             | grep -E "TPOT" | sed "s/^/pdl=$pdl /" | tee -a "$out/pdl_quick.log"; done
         TPGRAPH_GEMV=1 TPGRAPH_TRITON_PDL=1 TPGRAPH_LAST_SPLIT_REDUCES=1 timeout -k 5 150 torchrun --nproc-per-node $NPROC \
             bench/hf_parity.py --embed-std 4.0 --out "$out/hf_parity_all_bf16.json" > "$out/hf_parity_all_bf16.log" 2>&1
         echo "bf16 parity, all on: rc=$?"; grep -E "prompt|PASS" "$out/hf_parity_all_bf16.log"
         grep -v "Warning\|warn(" "$out/hf_parity_all_bf16.log" | tail -40 ;;
    teardown) # which opt-in path makes the job hang in destroy_process_group: HF parity bf16 with none, then PDL alone,
         # then the in-kernel reductions alone (each with hf_parity's 60 s teardown watchdog)
         for flags in "TPGRAPH_GEMV=0" "TPGRAPH_GEMV=1 TPGRAPH_TRITON_PDL=1" "TPGRAPH_GEMV=1 TPGRAPH_LAST_SPLIT_REDUCES=1"; do
             env $flags timeout -k 5 130 torchrun --nproc-per-node $NPROC bench/hf_parity.py --embed-std 4.0 \
                 > "$out/teardown.tmp" 2>&1; echo "$flags: rc=$? $(grep -c 'Timeout (0:01:00)' "$out/teardown.tmp") \
watchdog dumps, $(grep -E '^PASS' "$out/teardown.tmp")" | tee -a "$out/teardown.log"; pack; done ;;
    argmax) # the greedy argmax in one Triton launch (the default) against five torch kernels between steps
         # (TPGRAPH_FUSED_ARGMAX=0): its GPU tests, then whole steps of both (alternating processes; SHAPE, AB_ENTRY as for ab)
         timeout 200 python3 -m pytest tests/gpu/test_argmax_gpu.py -q -rs 2>&1 | tail -2 | tee "$out/argmax_tests.log"
         timeout 300 python3 bench/ab_decode.py --out "$out/ab_argmax" --nproc $NPROC --rounds 2 --variant fused=. \
             --variant two_stage=.:TPGRAPH_FUSED_ARGMAX=0 -- --shape "${SHAPE:-llama3-8b}" --modes full --batches 1,8,32 \
             --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" --context 512 --steps 100 2>&1 \
             | grep -E "^\||left out|Error" | tee "$out/ab_argmax.log" ;;
    polled) # issue 11: polled split-K partials (the default since session 24; =0 counts): its GPU tests and HF
         # parity with it on at 3 and at 24 rows a step; polled-ab then times whole steps at batches 1-32 against the
         # count (SHAPE as for overlap; NPROC ranks; each about 5-9 minutes: a device call of its own)
         TPGRAPH_POLLED_PARTIALS=1 timeout 300 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py \
             tests/unit/test_lamport_gemv.py tests/unit/test_gemv_kernel.py -q -rs \
             -k "small_m_split_k or last_split or polled or epilogue or across_phases" 2>&1 | tail -6 \
             | tee "$out/polled_tests.log"
         for copies in 1 8; do for dt in bf16 fp32; do TPGRAPH_POLLED_PARTIALS=1 timeout 200 torchrun --nproc-per-node \
             $NPROC bench/hf_parity.py --dtype $dt --copies $copies $([ $dt = bf16 ] && echo --embed-std 4.0) \
             --out "$out/hf_parity_polled_${dt}_x$copies.json" 2>&1 | grep -E "identical=False|PASS" \
             | sed "s/^/$dt x$copies /" | tee -a "$out/hf_parity_polled.log"; done; done ;;
    polled-ab) # the second half of polled: whole steps at batches 1-32, the count against polled partials (the qkv +
         # rope kernel's heads counted in both: TPGRAPH_POLLED_ROPE=0)
         timeout 560 python3 bench/ab_decode.py --out "$out/ab_polled" --nproc $NPROC --rounds 2 --variant count=.:TPGRAPH_POLLED_PARTIALS=0 \
             --variant polled=.:TPGRAPH_POLLED_PARTIALS=1,TPGRAPH_POLLED_ROPE=0 -- --shape "${SHAPE:-llama3-8b}" --modes full \
             --batches 1,2,4,8,16,24,32 --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" --context 512 \
             --steps 100 2>&1 | grep -E "^==|^\||left out|Error" | tee "$out/ab_polled.log" ;;
    polled-attn) # issue 11: decode attention's last split polling its partners' partials (TPGRAPH_POLLED_ATTENTION=1,
         # opt-in): the GPU tests of every polled reducer (attention, qkv + rope, the projections), HF parity with it
         # on at 3 and 24 rows, then whole steps against the count at 512 and 4K tokens (SHAPE, AB_ENTRY as for ab;
         # about 6 minutes; the limits add up to 590 s with the build skipped: TPG_SKIP_BUILD=1 on a warm machine)
         timeout 150 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs \
             -k "split_kv_decode_with_the_last or qkv_rope_store_gives or last_split_reduces" 2>&1 | tail -3 \
             | tee "$out/polled_attn_tests.log"
         for copies in 1 8; do TPGRAPH_POLLED_ATTENTION=1 timeout 90 torchrun --nproc-per-node $NPROC bench/hf_parity.py \
             --embed-std 4.0 --copies $copies --out "$out/hf_parity_polled_attn_x$copies.json" 2>&1 \
             | grep -E "identical=False|PASS" | sed "s/^/x$copies /" | tee -a "$out/hf_parity_polled_attn.log"; done
         for ctx in 512 4096; do timeout 130 python3 bench/ab_decode.py --out "$out/ab_polled_attn_$ctx" --nproc $NPROC \
             --rounds 2 --variant count=. --variant polled=.:TPGRAPH_POLLED_ATTENTION=1 -- --shape "${SHAPE:-llama3-8b}" \
             --modes full --batches 1,4,8,32 --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" \
             --context $ctx --steps 100 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab_polled_attn_$ctx.log"; done ;;
    polled-attn-debug) # issue 11: where TPGRAPH_POLLED_ATTENTION=1 failed in whole steps ("unspecified launch
         # failure" in every full-graph step of 2026-12-02_h200_polled_attention): the kernel at the model's grid
         # between two polled projections in a graph, then one batch-1 step process each as shipped, without PDL, and
         # eager, with the seconds each took to fail (a reducer that polls to its limit traps after seconds; a wrong
         # merge at once)
         timeout 240 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -x --durations=8 \
             -k "polled_attention_between" 2>&1 | tail -25 | tee "$out/polled_debug_tests.log"
         for run in "full:" "full:TPGRAPH_TRITON_PDL=0" "none:"; do mode=${run%%:*}; env_set=${run#*:}
           t0=$(date +%s)
           env TPGRAPH_POLLED_ATTENTION=1 $env_set timeout 150 torchrun --nproc-per-node 1 bench/bench_decode.py \
               --shape "${SHAPE:-llama3-8b}" --modes $mode --batches 1 --no-ladders \
               --allreduce custom+gemv+overlap --context 512 --steps 20 \
               --out "$out/polled_debug_$mode${env_set:+_nopdl}.json" \
               > "$out/polled_debug_$mode${env_set:+_nopdl}.log" 2>&1
           rc=$?; echo "$mode $env_set: exit $rc after $(( $(date +%s) - t0 )) s"
           grep -E "TPOT|Error|error" "$out/polled_debug_$mode${env_set:+_nopdl}.log" \
               | grep -v "^frame\|Search for" | head -6
         done ;;
    polled-attn-32) # issue 11: TPGRAPH_POLLED_ATTENTION=1 after the merge's stale count was made the block's (it
         # had hung batch-32 reducers: 4 of 6 whole-step processes ended in the poll limit's trap, runs 2-4 of
         # bench/results/2026-12-03_h200_polled_attention_fix): REPEATS (default 3) batch-32 processes of 20 steps,
         # then whole steps against the count at 512 tokens (batches 1, 8, 32; alternating processes, 2 rounds;
         # SHAPE, AB_ENTRY as for ab)
         for i in $(seq ${REPEATS:-3}); do t0=$(date +%s)
           TPGRAPH_POLLED_ATTENTION=1 timeout 100 torchrun --nproc-per-node 1 bench/bench_decode.py \
               --shape "${SHAPE:-llama3-8b}" --modes full --batches 32 --no-ladders \
               --allreduce "${AB_ENTRY:-custom+gemv+overlap}" --context 512 --steps 20 \
               --out "$out/polled_32_$i.json" > "$out/polled_32_$i.log" 2>&1
           echo "batch 32, process $i: exit $? after $(( $(date +%s) - t0 )) s" \
               "$(grep -oE 'TPOT +[0-9.]+ ms|Error.*' "$out/polled_32_$i.log" | head -1)"
         done
         timeout 200 python3 bench/ab_decode.py --out "$out/ab_polled_attn_512" --nproc $NPROC \
             --rounds 2 --variant count=. --variant polled=.:TPGRAPH_POLLED_ATTENTION=1 -- --shape "${SHAPE:-llama3-8b}" \
             --modes full --batches 1,8,32 --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" \
             --context 512 --steps 100 2>&1 | grep -E "^\||left out|Error" | tee "$out/ab_polled_attn_512.log" ;;
    read-ceiling) # issue 11: each projection's weight size read by a kernel that only reads (launch shapes swept; plain,
         # PDL waiting, PDL free), beside the shipped small-M kernel, by bench_kernels' method (a table and a plot)
         timeout 400 python3 bench/bench_read_ceiling.py --out "$out/read_ceiling.json" 2>&1 | tail -60 \
             | tee "$out/read_ceiling.log" ;;
    boundary) # what one kernel boundary costs in a graph (plain, PDL, PDL with the late trigger) against a software
         # grid barrier in one kernel, at 1-264 programs (bench/bench_pdl_boundary.py: a table and a plot)
         timeout 200 python3 bench/bench_pdl_boundary.py --grids 1,33,132,264 --out "$out/boundary.json" 2>&1 \
             | tail -8 | tee "$out/boundary.log" ;;
    wide-m) # issue 11, batch 32: TPGRAPH_GEMV_MAX_M=32 (the default since session 15; 17-32 rows through the small-M kernels and the epilogue's
         # add + norm, instead of cuBLAS and the unfused rope / SiLU / norm kernels; the table's entries from 17
         # rows): its GPU tests, HF parity at 24 rows a step with it on, whole steps at batches 16, 24 and 32 with it
         # off and on (alternating processes; SHAPE, AB_ENTRY as for ab), and the batch-32 profile of both
         timeout 300 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py tests/unit/test_lamport_gemv.py -q -rs \
             -k "wide or ((qkv_rope or gate_up_epilogue) and (24 or 32))" 2>&1 | tail -3 | tee "$out/wide_tests.log"
         TPGRAPH_GEMV_MAX_M=32 timeout 200 torchrun --nproc-per-node $NPROC bench/hf_parity.py --embed-std 4.0 \
             --copies 8 --out "$out/hf_parity_wide.json" 2>&1 | grep -E "PASS|identical=False" | tee "$out/hf_parity_wide.log"
         # m32e: the epilogue projections (o_proj, down) in 32x128 tiles, which the all-reduce epilogue compiles
         # without spilling at 32 rows (the swept 32x512 tiles: 255 registers and 144 bytes spilled with it, sm_90a)
         timeout 400 python3 bench/ab_decode.py --out "$out/ab_wide" --nproc $NPROC --rounds 2 --variant m16=.:TPGRAPH_GEMV_MAX_M=16 \
             --variant m32=.:TPGRAPH_GEMV_MAX_M=32 --variant m32e=.:TPGRAPH_GEMV_MAX_M=32 \
             --tiles m32e=epilogue:4096,2048,17=32x128x4x5x1/epilogue:4096,7168,17=32x128x4x5x1 \
             -- --shape "${SHAPE:-llama3-8b}" --modes full --batches 16,24,32 \
             --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" --context 512 --steps 100 2>&1 \
             | grep -E "^\||left out|Error" | tee "$out/ab_wide.log"
         for m in 16 32; do TPGRAPH_GEMV_MAX_M=$m timeout -k 5 200 torchrun --nproc-per-node $NPROC bench/bench_decode.py \
             --shape "${SHAPE:-llama3-8b}" --modes full --batches 32 --no-ladders --allreduce "${AB_ENTRY:-custom+gemv+overlap}" \
             --profile --profile-batches 32 --steps 20 --out "$out/profile_wide_m$m.json" 2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" \
             | tail -24 | tee "$out/profile_wide_m$m.log"; done ;;
    attn-prefetch) # issue 11: decode attention asking L2 for its split's later tiles before its wait, and then one more
         # each loop turn (TPGRAPH_ATTN_L2_PREFETCH=1; sm_90a: at 2 stages without the read-ahead the loop waits out
         # each later tile's HBM round trip in turn): the GPU tests (prefetch changes no bit, the newest row seen),
         # attention alone with and without it by the sweep's one method (longer splits beside the heuristic's, which a
         # prefetch may now pay for), then whole steps at each of AB_CONTEXTS (default 512; alternating processes;
         # SHAPE, AB_ENTRY as for ab). L2_TILES: the prefetch depths swept (session 15 timed only the budget rule's, 2
         # at batches 8-32: slower alone there, 24 MB asked of the 50 MB L2 at once, perhaps evicted before use; 1 is
         # the next to try)
         timeout 300 python3 -m pytest tests/gpu/test_fused_kernels_gpu.py -q -rs -k "prefetch or newest_row or split_kv" \
             2>&1 | tail -3 | tee "$out/prefetch_tests.log"
         timeout 240 python3 bench/bench_attention_sweep.py --points "${ATTN_POINTS:-1x512,8x512,32x512,1x4096,8x4096}" \
             --block-n 64 --warps 4 --stages 2 --split-scales 0.5,1 --split-tiles auto,1 --l2-prefetch ${L2_TILES:-0,1,2} \
             --out "$out/prefetch_sweep.json" 2> "$out/prefetch_sweep.err" | tee "$out/prefetch_sweep.log"; pack
         for ctx in ${AB_CONTEXTS:-512}; do timeout 240 python3 bench/ab_decode.py --out "$out/ab_prefetch_$ctx" \
             --nproc $NPROC --rounds 2 --variant off=. --variant l2=.:TPGRAPH_ATTN_L2_PREFETCH=1 -- \
             --shape "${SHAPE:-llama3-8b}" --modes full --batches 1,8,32 --no-ladders \
             --allreduce "${AB_ENTRY:-custom+gemv+overlap}" --context $ctx --steps 100 2>&1 \
             | grep -E "^\||left out|Error" | tee "$out/ab_prefetch_$ctx.log"; pack; done ;;
    attn-sweep) # issue 11: decode attention's launch shapes (tile length, warps, stages, split count, split tiles) per
         # batch x context against the shipped heuristic, each alone by the one timing method (bench_attention_sweep.py;
         # ATTN_SWEEP_ARGS: more of its arguments)
         timeout 500 python3 bench/bench_attention_sweep.py --points "${ATTN_POINTS:-1x512,8x512,32x512}" \
             --out "$out/attn_sweep.json" ${ATTN_SWEEP_ARGS:-} 2> "$out/attn_sweep.err" \
             | tee "$out/attn_sweep.log"  # (progress: stderr)
         tr '\r' '\n' < "$out/attn_sweep.err" | grep -v "shape/s\]\|s/shape\]" | tail -5 ;;
    l2-carry) # issue 11: whether L2 keeps a prefetched weight (evict_last) while 176 MB stream past it (evict_first),
         # read after each sequence by one kernel alone (bench_l2_carry.py)
         timeout 300 python3 bench/bench_l2_carry.py --out "$out/l2_carry.json" 2>&1 | tee "$out/l2_carry.log" ;;
    profile) # issue 11: kernels per step, time per category and the time each kernel adds: cuBLAS, the small-M
         # kernels (the default path: PDL and last-split reductions on), and the small-M kernels with both off
         # (PROFILE_ENTRY and PROFILE_BATCHES override the entries and batches; SHAPE and AB_CONTEXT as for ab)
         timeout -k 5 300 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" \
             --context "${AB_CONTEXT:-512}" --modes full --batches "${PROFILE_BATCHES:-1,8}" \
             --profile-batches "${PROFILE_BATCHES:-1,8}" --no-ladders \
             --allreduce "${PROFILE_ENTRY:-custom,custom+gemv,custom+gemv+nopdl+nolr}" --profile --steps 20 \
             --out "$out/profile.json" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -60 | tee "$out/profile.log" ;;
    flags) # issue 11: Triton PDL (+ L2 weight prefetch) and in-kernel split reductions, each alone and together
         # (2x2), every run with cuBLAS "custom" beside the small-M kernels as the in-run reference, interleaved
         for pdl in 0 1; do for lr in 0 1; do TPGRAPH_TRITON_PDL=$pdl TPGRAPH_LAST_SPLIT_REDUCES=$lr timeout -k 5 120 \
             torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8 --no-ladders \
             --allreduce custom,custom+gemv --interleave --steps 60 --out "$out/decode_pdl${pdl}_lr${lr}.json" 2>&1 \
             | grep -E "TPOT" | sed "s/^.*\r//; s/^/pdl=$pdl lr=$lr /" | tee -a "$out/flags.log"; pack; done; done ;;
    pdl-late) # issue 11: the small-M kernels let their dependents in after the K loop (not at the start): PDL off,
         # PDL with a 24 MB L2 weight prefetch, PDL with one tile per program (budget 0, the default); cuBLAS "custom"
         # beside them in every run, interleaved. PDL_SETTINGS: the runs, as pdl:prefetch-MB pairs
         n=0; for setting in $(echo "${PDL_SETTINGS:-0:24 1:24 1:0}"); do IFS=: read -r pdl mb <<< "$setting"; mb=${mb:-0}; n=$((n + 1))
             TPGRAPH_TRITON_PDL=$pdl TPGRAPH_PDL_PREFETCH_MB=$mb \
             timeout -k 5 120 torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8 \
             --no-ladders --allreduce custom,custom+gemv --interleave --steps 60 --out "$out/decode_${n}_pdl${pdl}_mb$mb.json" \
             2>&1 | grep -E "TPOT" | sed "s/^.*\r//; s/^/pdl=$pdl prefetch=${mb}MB /" | tee -a "$out/pdl_late.log"; pack
         done ;;
    pdl-default) # issue 11: Triton PDL and last-split reductions (both on by default) against each off, in one
         # interleaved process (graphs captured under each entry's setting): cuBLAS and small-M projections, bs 1 / 8 / 32
         timeout -k 5 300 torchrun --nproc-per-node $NPROC bench/bench_decode.py --modes full --batches 1,8,32 \
             --no-ladders --allreduce custom+nopdl,custom,custom+gemv+nopdl+nolr,custom+gemv+nolr,custom+gemv \
             --interleave --steps 100 --out "$out/decode_pdl_default.json" 2>&1 | grep -E "TPOT" | sed "s/^.*\r//" \
             | tee "$out/pdl_default.log"
         python3 bench/report_decode.py "$out/decode_pdl_default.json" --entry custom+gemv \
             | tee -a "$out/pdl_default.log" ;;
    acceptance) # issue 11's performance lines in one call on NPROC GPUs (TP=NPROC; SHAPE as for overlap, context 512),
         # judged by bench/report_decode.py. At NPROC >= 2, first the exactness tests of the all-reduce in the
         # projections' epilogue (+push, never run on two GPUs before): if they fail, +push is left out and said. Then
         # every decode kernel alone at batch 1 (each projection's bandwidth; kernels.json from a kernel-bench step
         # before it in the same call is used instead), one bench_decode.py run of full graphs at batches 1, 8 and 32,
         # interleaved, with each fused entry beside its unfused twin (the plain chain +nopush, and +push, whose twin is
         # +nopush...+unfused), the profile of the judged entry at batch 1 (kernels per step), and the verdict.
         # ACCEPT_ENTRY (default: +push where it passed, else the plain chain) is the entry the TPOT and kernel lines
         # judge; it is timed too. Typical time unknown (not yet run); the limits add up to 580 s, so run it as the
         # call's one step (each command's results are packed as it ends).
         plain=custom+gemv+nopush+overlap; push=custom+gemv+push+overlap; ents=$plain,$push
         if [ "$NPROC" -ge 2 ]; then
           timeout -k 5 150 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rfEs -k epilogue 2>&1 | tail -6 \
               | tee "$out/accept_epilogue_tests.log"
           log="$out/accept_epilogue_tests.log"
           grep -q " passed" "$log" && ! grep -qE "failed|error" "$log" \
             || { echo "the epilogue all-reduce's tests did not pass: +push left out"; ents=$plain; push=$plain; }
           pack
         fi
         acc=${ACCEPT_ENTRY:-$push}
         case ",$ents," in *",$acc,"*) ;; *) ents=$ents,$acc ;; esac
         [ -f "$out/kernels.json" ] || timeout -k 5 90 python3 bench/bench_kernels.py --batches 1 --contexts 512 \
             --out "$out/kernels.json" 2>&1 | tail -40 | tee "$out/kernels.log"; pack
         timeout -k 5 240 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" \
             --modes full --batches 1,8,32 --no-ladders --allreduce "$ents" --unfused --interleave --steps ${ACCEPT_STEPS:-100} \
             --out "$out/decode_accept.json" 2>&1 | grep -E "TPOT|Error|error" | tee "$out/bench_accept.log"; pack
         timeout -k 5 100 torchrun --nproc-per-node $NPROC bench/bench_decode.py --shape "${SHAPE:-llama3-8b}" \
             --modes full --batches 1 --profile-batches 1 --no-ladders --allreduce "$acc" --profile --steps 20 \
             --out "$out/profile_accept.json" 2>&1 | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -30 \
             | tee "$out/profile_accept.log"
         # (always: a JSON a crashed or timed-out run left unwritten is a failed line of the verdict, not no verdict)
         python3 bench/report_decode.py "$out/decode_accept.json" --entry "$acc" --kernels "$out/kernels.json" \
             --profile "$out/profile_accept.json" | tee "$out/acceptance.md" ;;
    kernel-bench) # issue 11: every decode kernel against its bandwidth floor; attention against SDPA at 512 / 4K / 32K
         timeout 400 python3 bench/bench_kernels.py --out "$out/kernels.json" 2>&1 | tail -60 \
             | tee "$out/kernels.log" ;;
    kernel-bench-nopdl) # the same with the Triton kernels launched without PDL: each call waits for the last to end
         TPGRAPH_TRITON_PDL=0 timeout 400 python3 bench/bench_kernels.py --out "$out/kernels_nopdl.json" 2>&1 \
             | tail -60 | tee "$out/kernels_nopdl.log" ;;
    tune) # issue 10: the tuner at world size NPROC (rewrites the SM90 rows of that world size in place), its log and plot
         timeout 580 python3 -m tpgraph.tune.cli --world-size $NPROC --plot "$out/tune.png" --log "$out/tune.json" 2>&1 \
             | grep -v "tuning:" | tail -20 | tee "$out/tune.log"
         git diff --stat -- configs/ | tee -a "$out/tune.log"; cp configs/allreduce/sm90.json "$out/sm90.json" ;;
    allreduce) # issue 10: every candidate by the one method, then the checks
         timeout 580 torchrun --nproc-per-node $NPROC bench/bench_allreduce.py --out "$out/ar.json" 2>&1 | tail -30 \
             > "$out/ar.log"; python3 bench/report_allreduce.py "$out/ar.json" 2>&1 | tee "$out/ar_report.md" ;;
    ar-tests) # issue 10: the exactness tests that can fail where it matters
         timeout 580 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rs -k \
             "random_normal or many_graphs or pdl_on_and_off or extra_push" 2>&1 | tail -25 | tee "$out/ar_tests.log" ;;
    ar-pieces) # issue 10: 1shot_push above its slot, in pieces: rank-order bits, NCCL's result, eager and graph
         timeout 300 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rs -k "pieces" 2>&1 | tail -8 \
             | tee "$out/ar_pieces.log" ;;
    ar-exact) # issues 10, 12: every exactness test of the custom all-reduce at world size NPROC (every algorithm
         # forced, eager and graph, against NCCL; random-normal rank-order sums; fused norm; PDL on/off; ar-tests'
         # extra push slot, so that the two need not run together)
         timeout 580 python3 -m pytest tests/gpu/test_custom_ar_gpu.py -q -rs -k \
             "equals_nccl or zero_copy or fused_all_reduce or random_normal or many_graphs or pdl_on_and_off or extra_push" \
             2>&1 \
             | tail -25 | tee "$out/ar_exact.log" ;;
    structured) need_xgrammar  # structured outputs' decode steps, overlapped or in turn (bench_structured_steps.py)
         mkdir -p "$out/llama3_8b_cfg" && python3 -c "import json, sys; json.dump({'architectures': ['LlamaForCausalLM'],
             'model_type': 'llama', 'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336,
             'num_hidden_layers': 32, 'num_attention_heads': 32, 'num_key_value_heads': 8, 'rms_norm_eps': 1e-5,
             'rope_theta': 500000.0, 'max_position_embeddings': 8192, 'torch_dtype': 'bfloat16',
             'bos_token_id': 128000, 'eos_token_id': 128001}, open(sys.argv[1], 'w'))" "$out/llama3_8b_cfg/config.json"
         timeout 300 python3 bench/bench_structured_steps.py "$out/llama3_8b_cfg" --out "$out/structured_steps.json" 2>&1 \
             | grep -E "^\{|Error" | tee "$out/structured_steps.log" ;;
    engine-steps-ab) need_xgrammar  # whole engine steps (bench_engine_steps.py: the sampler, the host's work) of package
         # trees in alternating processes, as ab does for the forward alone. ES_VARIANTS: LABEL=DIR ... ("new=. old=
         # ab/old"; prepare the trees before the call: python bench/ab_decode.py --prepare REV ab/old); ES_ROUNDS (2),
         # ES_BATCHES (8,64,256), ES_PROMPT (1024), ES_MIXES (greedy,logit-bias,one-regex), SHAPE (llama3-8b-half)
         mkdir -p "$out/engine_steps"
         for round in $(seq "${ES_ROUNDS:-2}"); do
           for variant in ${ES_VARIANTS:?set ES_VARIANTS to LABEL=DIR pairs}; do
             label=${variant%%=*} tree=${variant#*=}
             ls "$tree"/tpgraph/_C*.so > /dev/null 2>&1 || cp tpgraph/_C*.so "$tree/tpgraph/"  # (a prepared tree)
             echo "--- $label round $round"
             PYTHONPATH=$(realpath "$tree"):$PYTHONPATH timeout 240 python3 bench/bench_engine_steps.py --warmup \
                 --shape "${SHAPE:-llama3-8b-half}" --batches "${ES_BATCHES:-8,64,256}" --prompt-len "${ES_PROMPT:-1024}" \
                 --mixes "${ES_MIXES:-greedy,logit-bias,one-regex}" --out "$out/engine_steps/${label}_r$round.json" 2>&1 \
                 | grep -oE "batch +[0-9]+ prompt .*|[A-Za-z]*Error.*" | tee -a "$out/engine_steps.log"
           done
         done ;;
    api-servers) need_server  # the HTTP front ends' streaming capacity against --api-server-count (bench_api_servers.py:
         # a fake engine, no GPU; on this machine's cores): AS_COUNTS (1,2,4), AS_STREAMS (256), AS_STEP_MS (0: the
         # front ends' ceiling), AS_API (completions)
         timeout 500 python3 bench/bench_api_servers.py --api-server-counts "${AS_COUNTS:-1,2,4}" \
             --streams "${AS_STREAMS:-256}" --tokens 256 --step-ms "${AS_STEP_MS:-0}" --api "${AS_API:-completions}" \
             --out "$out/api_servers.json" --plot "$out/api_servers.png" 2>&1 | grep -v "nanobind\|leaked" \
             | tail -20 | tee "$out/api_servers.log" ;;
    engine-tests) need_xgrammar  # (structured outputs' tests)
         timeout 300 python3 -m pytest tests/gpu/test_engine_gpu.py tests/gpu/test_varlen_prefill_gpu.py \
             tests/gpu/test_uploads_gpu.py tests/gpu/test_sampler_gpu.py -q -rfEs 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" > "$out/engine_tests.log"  # (whole: failures' tracebacks)
         tail -20 "$out/engine_tests.log" ;;
    full-bench) timeout 580 torchrun --nproc-per-node $NPROC bench/bench_decode.py --profile --out "$out/decode.json" 2>&1 \
             | grep -v "it/s\]\|tensor/s\]\|graph/s\]" | tail -80 | tee "$out/bench.log" ;;
  esac
  trap - ERR
  pack
  if [ "$step_ok" = 1 ]; then echo "=== $step: ok"; else echo "=== $step: FAILED (a command exited non-zero)"
    failed="$failed $step"; fi
done
echo "=== done $(date +%T)"
if [ -n "$failed" ]; then echo "=== failed steps:$failed"; exit 1; fi
