#!/usr/bin/env bash
# k-step Adam over a slow link, measured for real: two "nodes" are network namespaces
# joined by a veth pair, each end rate-limited by `tc qdisc ... tbf`. Two ranks (one per
# namespace) train with gloo over that link for each configuration in turn:
#   k1         KStepAdamStrategy(k=1): synchronous, gradients averaged every step
#   k16        KStepAdamStrategy(k=16): local Adam steps, models merged every 16
#              (parameters in float32, Adam's moments in bfloat16: the default)
#   k16_fp32   the same with moment_dtype="float32": moments averaged exactly
#   k16_overlap  the same with overlap=True: each merge travels during the next 16 steps
#   ddp_avg16  Lightning's DDPStrategy(model_averaging_period=16) (post-local SGD)
# and, with 26 row-wise sharded tables (dim 16, Zipf ids) under the same over-arch:
#   emb_sync     dense k=1, sparse_sync="step": fully synchronous training
#   emb_step     dense k=16, sparse_sync="step" (all-to-alls of ids and pooled rows every step)
#   emb_sparse16 dense k=1, sparse_sync="k_step" (replicas, deltas to owners every 16 steps)
#   emb_k16      dense k=16, sparse_sync="k_step": k-step for both parts
#   emb_k16_fp32 (on request) the same with the tables' optimizer state sent in float32
# It prints steps/s, the bytes rank 0 sent and received across the link per timed step
# as the kernel counts them (the veth end's tx_bytes / rx_bytes in its namespace, read
# before and after the timed steps; TCP/IP headers included), the bytes the code's own
# model expects it to send (a cross-check) and the tables' share of that model, and the
# ratios (from the measured bytes sent), for each rate of RATES (tbf), and last the line `k16 dense+sparse / synchronous: X.XXx steps/s, Y.Yx fewer
# bytes` (at the first rate). Needs root (ip netns). The namespaces and addresses
# (10.77.0.1/2) are created here and removed on exit.
#   sudo RATES="100mbit 1gbit" STEPS=68 BATCH=256 benchmarks/bench_kstep.sh
#   sudo RATES=100mbit CONFIGS="k1 k16" benchmarks/bench_kstep.sh     # a subset
set -euo pipefail
RATES=${RATES:-${RATE:-100mbit 1gbit}}
STEPS=${STEPS:-68}  # 4 untimed, then 64: exactly one merge per 16 timed steps
BATCH=${BATCH:-256}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
NS0=ctrk_node0 NS1=ctrk_node1

cleanup() { ip netns del "$NS0" 2>/dev/null || true; ip netns del "$NS1" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$NS0"
ip netns add "$NS1"
ip link add ctrk_veth0 type veth peer name ctrk_veth1
ip link set ctrk_veth0 netns "$NS0"
ip link set ctrk_veth1 netns "$NS1"
for i in 0 1; do
  ns=ctrk_node$i
  ip -n "$ns" addr add 10.77.0.$((i + 1))/24 dev ctrk_veth$i
  ip -n "$ns" link set lo up
  ip -n "$ns" link set ctrk_veth$i up
done

FINAL=""
for RATE in $RATES; do
  for i in 0 1; do
    ip netns exec ctrk_node$i tc qdisc replace dev ctrk_veth$i root tbf rate "$RATE" burst 64kb latency 50ms
  done
  printf "\n%s link between two namespaces, 2 nodes x 1 rank, gloo, %s steps of batch %s\n" "$RATE" "$STEPS" "$BATCH"
  printf "%-13s %10s %16s %16s %16s %16s\n" configuration steps/s "sent/step" "received/step" "model: sent" "model: tables"
  PAIRS=()
  for config in ${CONFIGS:-k1 k16 k16_fp32 k16_overlap ddp_avg16 emb_sync emb_step emb_sparse16 emb_k16}; do
    port=$((29600 + RANDOM % 1000))
    for rank in 1 0; do
      env MASTER_ADDR=10.77.0.1 MASTER_PORT=$port WORLD_SIZE=2 NODE_RANK=$rank LOCAL_RANK=0 \
          GLOO_SOCKET_IFNAME=ctrk_veth$rank PYTHONWARNINGS=ignore \
          timeout 900 ip netns exec ctrk_node$rank "$PY" "$ROOT/benchmarks/bench_kstep.py" --config "$config" \
          --steps "$STEPS" --batch "$BATCH" > "/tmp/ctrk_$config.$rank.log" 2>&1 &
    done
    wait
    line=$(grep '^RESULT ' "/tmp/ctrk_$config.0.log" | sed 's/^RESULT //') || {
      echo "$config failed:"; tail -20 "/tmp/ctrk_$config.0.log" "/tmp/ctrk_$config.1.log"; exit 1; }
    read -r rate sent received modelled tables < <("$PY" -c "import json,sys; r=json.loads(sys.argv[1]); print(r['steps_per_s'], int(r['sent_per_step']), int(r['received_per_step']), int(r['modelled_per_step']), int(r['table_bytes_per_step']))" "$line")
    PAIRS+=("$config=$rate=$sent")
    printf "%-13s %10.3f %16d %16d %16d %16d\n" "$config" "$rate" "$sent" "$received" "$modelled" "$tables"
  done
  # Ratios go to the terminal; the k16-both-parts line of the first rate is kept for the end.
  line=$("$PY" "$ROOT/benchmarks/kstep_ratios.py" "$RATE" "${PAIRS[@]}")
  [ -z "$FINAL" ] && FINAL=$line
done
[ -n "$FINAL" ] && echo "$FINAL"
