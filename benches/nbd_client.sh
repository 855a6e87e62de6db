#!/usr/bin/env bash
# The NBD client: `qimg convert` against `qemu-img convert` and nbdcopy, each copying a
# qemu-nbd export (a 1 GiB qcow2 image with 768 MiB of data, read-only) into a raw file on
# tmpfs (so that the output disk does not decide), once with one client at a time (`-e 1`:
# no multi-conn, one connection) and once with `-e 4` (multi-conn: qimg opens up to four
# connections as its parallel chunks find them busy, nbdcopy four, qemu-img one).
#
#   benches/nbd_client.sh
#   REPS=5 benches/nbd_client.sh
#
# Columns: the best wall time of REPS runs of each tool (the machine is shared: interference
# only slows a run down), the tools alternating within each round, and qemu-img's and
# nbdcopy's time over qimg's (> 1: qimg is faster).
#
# Environment: QIMG (binary; default: build target/release/qimg), BENCH_DIR (scratch; default
# a fresh directory under ${TMPDIR:-/var/tmp}, removed at the end unless KEEP=1), OUT_DIR
# (where the copies go; default /dev/shm), REPS (3).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
REPS=${REPS:-3}
OUT_DIR=${OUT_DIR:-/dev/shm}
for tool in qemu-img qemu-io qemu-nbd nbdcopy; do
    command -v "$tool" >/dev/null || { echo "$tool not found (install qemu-utils, libnbd-bin)" >&2; exit 1; }
done
if [[ -z "${QIMG:-}" ]]; then
    (cd "$here" && cargo build --release -q -p qimg-cli)
    QIMG=$here/target/release/qimg
fi
dir=${BENCH_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/qimg-nbd-client.XXXXXX")}
mkdir -p "$dir"
out=$OUT_DIR/qimg-nbd-client-$$.raw
server_pid=
cleanup() {
    [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null || true
    rm -f "$out"
    [[ "${KEEP:-0}" == 1 ]] || rm -rf "$dir"
}
trap cleanup EXIT

qemu-img create -q -f qcow2 "$dir/a.qcow2" 1G
qemu-io -c "write -P 0x5a 0 768M" "$dir/a.qcow2" >/dev/null
sock=$dir/s.sock
uri="nbd+unix:///?socket=$sock"

# secs CMD...: wall seconds of one run.
secs() {
    local s e
    rm -f "$out"
    s=$(date +%s.%N)
    "$@" >/dev/null
    e=$(date +%s.%N)
    awk -v s="$s" -v e="$e" 'BEGIN { printf "%.3f\n", e - s }'
}

echo "| qemu-nbd | qimg convert | qemu-img convert | nbdcopy | qemu-img / qimg | nbdcopy / qimg |"
echo "|---|---:|---:|---:|---:|---:|"
for shared in 1 4; do
    rm -f "$sock" "$dir/pid"
    qemu-nbd -r -e "$shared" -t -k "$sock" --pid-file="$dir/pid" -f qcow2 "$dir/a.qcow2" &
    server_pid=$!
    for _ in $(seq 200); do [[ -s "$dir/pid" ]] && break; sleep 0.05; done
    q=(); e=(); n=()
    for _ in $(seq "$REPS"); do
        q+=("$(secs "$QIMG" convert -f raw -O raw "$uri" "$out")")
        e+=("$(secs qemu-img convert -f raw -O raw "$uri" "$out")")
        n+=("$(secs nbdcopy "$uri" "$out")")
    done
    kill -TERM "$server_pid"; wait "$server_pid" || true; server_pid=
    bq=$(printf '%s\n' "${q[@]}" | sort -n | head -1)
    be=$(printf '%s\n' "${e[@]}" | sort -n | head -1)
    bn=$(printf '%s\n' "${n[@]}" | sort -n | head -1)
    awk -v s="$shared" -v q="$bq" -v e="$be" -v n="$bn" 'BEGIN {
        printf "| -e %s | %.2f s | %.2f s | %.2f s | %.2f | %.2f |\n", s, q, e, n, e / q, n / q }'
done
