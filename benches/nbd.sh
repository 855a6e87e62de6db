#!/usr/bin/env bash
# qimg serve --nbd vs qemu-nbd: qemu-img bench through nbd+unix:// against each server
# exporting the same image, as ratios.
#
#   benches/nbd.sh
#   COUNT=100000 REPS=5 benches/nbd.sh
#
# Rows (4 KiB requests, both servers with -t none, i.e. O_DIRECT on the image file):
#   read  QD1 / QD32   scattered reads of a fully written image: qemu-img bench has no random
#                      mode, so requests walk the disk with a stride of 7 MiB + 4 KiB
#                      (wrapping), which touches every L2 table and defeats readahead
#   write QD1 / QD32   allocating writes to an empty image, one per 64 KiB cluster (stride
#                      68 KiB); the image is made afresh before every run
#
# Columns: IOPS through qimg serve and through qemu-nbd (each the best of REPS runs: the
# machine is shared, interference only slows a run down), their ratio (> 1: qimg is faster),
# and the median of the REPS per-round ratios. The two servers alternate, one run each per
# round, so that a change in the machine's state (other load, the host's cache of the disk,
# idle CPUs) hits both alike.
#
# Environment: QIMG (binary; default: build target/release/qimg), BENCH_DIR (scratch; default
# a fresh directory under ${TMPDIR:-/var/tmp}, removed at the end unless KEEP=1), SIZE
# (image size, 1G), COUNT (requests per run, 50000), REPS (3), QIMG_AIO (`-i` for qimg serve;
# default its own default, like qemu-nbd's).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-1G}
COUNT=${COUNT:-50000}
REPS=${REPS:-3}
for tool in qemu-img qemu-io qemu-nbd; do
    command -v "$tool" >/dev/null || { echo "$tool not found (install qemu-utils)" >&2; exit 1; }
done
if [[ -z "${QIMG:-}" ]]; then
    (cd "$here" && cargo build --release -q -p qimg-cli)
    QIMG=$here/target/release/qimg
fi
dir=${BENCH_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/qimg-nbd-bench.XXXXXX")}
mkdir -p "$dir"
server_pid=
cleanup() {
    [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null || true
    [[ "${KEEP:-0}" == 1 ]] || rm -rf "$dir"
}
trap cleanup EXIT

sock=$dir/s.sock
pidfile=$dir/server.pid

# start_server qimg|qemu IMAGE: serves IMAGE on $sock and waits until it accepts.
start_server() {
    rm -f "$sock" "$pidfile"
    case $1 in
    qimg) "$QIMG" serve --nbd "unix:$sock" -t none ${QIMG_AIO:+-i "$QIMG_AIO"} --persistent \
            --pidfile "$pidfile" "$2" & ;;
    qemu) qemu-nbd --socket="$sock" --format=qcow2 --cache=none --persistent \
            --pid-file="$pidfile" "$2" & ;;
    esac
    server_pid=$!
    for _ in $(seq 200); do [[ -s "$pidfile" ]] && return; sleep 0.05; done
    echo "$1 server did not start" >&2
    exit 1
}

stop_server() {
    kill -TERM "$server_pid"
    wait "$server_pid" || true
    server_pid=
}

# bench ARGS...: IOPS of one qemu-img bench run through the export.
bench() {
    local out secs
    out=$(qemu-img bench -f raw -c "$COUNT" -s 4096 "$@" "nbd+unix:///?socket=$sock")
    secs=$(sed -n 's/^Run completed in \([0-9.]*\) seconds\./\1/p' <<<"$out")
    awk -v c="$COUNT" -v s="$secs" 'BEGIN { printf "%d\n", c / s }'
}

best() { sort -n | tail -1; }

full=$dir/full.qcow2
qemu-img create -q -f qcow2 "$full" "$SIZE"
qemu-io -f qcow2 -c "write -P 0x5a 0 $SIZE" "$full" >/dev/null

# read_once SERVER DEPTH: IOPS of one read run.
read_once() {
    start_server "$1" "$full"
    bench -d "$2" -S $((7 * 1048576 + 4096))
    stop_server
}

# write_once SERVER DEPTH: IOPS of one write run on a fresh image.
write_once() {
    qemu-img create -q -f qcow2 "$dir/empty.qcow2" "$SIZE"
    start_server "$1" "$dir/empty.qcow2"
    bench -w -d "$2" -S $((68 * 1024))
    stop_server
}

median() { sort -n | awk '{ v[NR] = $1 } END { printf "%.2f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

printf '%-14s %12s %12s %8s %8s
' row "qimg IOPS" "qemu-nbd" ratio median
for kind in read write; do
    for depth in 1 32; do
        qs=() ns=() rs=()
        for _ in $(seq "$REPS"); do
            q=$(${kind}_once qimg "$depth")
            n=$(${kind}_once qemu "$depth")
            qs+=("$q") ns+=("$n")
            rs+=("$(awk -v a="$q" -v b="$n" 'BEGIN { printf "%.4f", a / b }')")
        done
        q=$(printf '%s\n' "${qs[@]}" | best)
        n=$(printf '%s\n' "${ns[@]}" | best)
        r=$(awk -v a="$q" -v b="$n" 'BEGIN { printf "%.2f", a / b }')
        m=$(printf '%s\n' "${rs[@]}" | median)
        printf '%-14s %12s %12s %8s %8s\n' "$kind QD$depth" "$q" "$n" "$r" "$m"
    done
done
