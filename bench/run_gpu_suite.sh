#!/usr/bin/env bash
# The GPU tests and the GPU benchmarks in one go, each step's log and JSON into OUTDIR.
#
#   bash bench/run_gpu_suite.sh OUTDIR [tests] [verify] [pdl] [gemm] [attention] [kernels] [draft] [topk] [select] [round] [transport] [serve]
#
# With no steps named, runs them all (about 22 minutes on an H200). "tests" is the whole of
# tests/gpu; "tests-graphs" (tests/gpu/test_cuda_graphs.py) and "tests-rest" (the other files)
# are its two halves, for machines that allow only a few minutes per command. Needs the
# project's dependencies importable by python3; PYTHONPATH gets the repository root added.
set -u
out=${1:?usage: bash bench/run_gpu_suite.sh OUTDIR [steps...]}
shift
steps=${*:-tests verify pdl gemm attention kernels draft topk select round transport serve}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
for step in $steps; do
    case $step in
        tests) cmd=(python3 -m pytest -q -rsxX -p no:cacheprovider --tb=short tests/gpu) ;;
        tests-graphs) cmd=(python3 -m pytest -q -rsxX -p no:cacheprovider --tb=short tests/gpu/test_cuda_graphs.py) ;;
        tests-rest) cmd=(python3 -m pytest -q -rsxX -p no:cacheprovider --tb=short tests/gpu
                         --ignore tests/gpu/test_cuda_graphs.py) ;;
        verify) cmd=(python3 bench/verify.py --out-json "$out/verify.json") ;;
        pdl) cmd=(python3 bench/pdl.py --batches 1,32 --trees 0,15,63 --out-json "$out/pdl.json") ;;
        gemm) cmd=(python3 bench/gemm.py --out-json "$out/gemm.json") ;;
        attention) cmd=(python3 bench/attention.py --batches 1,16,32 --trees 0,16,64 --out-json "$out/attention.json") ;;
        kernels) cmd=(python3 bench/kernels.py --batches 1,4,16,32 --trees 16,64,128 --out-json "$out/kernels.json") ;;
        draft) cmd=(python3 bench/draft_step.py --out-json "$out/draft.json") ;;
        topk) cmd=(python3 bench/draft_topk.py --out-json "$out/draft_topk.json") ;;
        select) cmd=(python3 bench/tree_select.py --device cuda --vocab 151936 --budget 15 --out-json "$out/tree_select.json") ;;
        round) cmd=(python3 bench/round.py --sessions 1,8,32 --out-json "$out/round.json") ;;
        transport) cmd=(python3 bench/transport.py --out-json "$out/transport.json") ;;
        serve) cmd=(python3 bench/serve.py --models qwen3-8b,default --concurrency 1,4,8,16,32,64 --max-new-tokens 128
                    --taus 3,6 --log-dir "$out/serve_logs" --out-json "$out/serve.json") ;;
        *) echo "unknown step: $step" >&2; exit 2 ;;
    esac
    echo "== $step: ${cmd[*]}"
    start=$SECONDS
    "${cmd[@]}" 2>&1 | tee "$out/$step.log"
    rc=${PIPESTATUS[0]}
    echo "== $step: exit $rc after $((SECONDS - start)) s"
    [ "$rc" = 0 ] || status=1
done
exit $status
