#!/usr/bin/env bash
# The cost of changed-block tracking on 4 KiB writes: qimg without a bitmap, with one enabled
# persistent bitmap kept as QEMU keeps it (`--bitmaps qemu`: marked in use while open, only
# memory is touched per write), and kept crash-consistent (the default: a granule's bit is on
# disk before the first write that changes it), against qemu-img with the same bitmap. O_DIRECT
# on io_uring (-t none -i io_uring), queue depths 1 and 32, one 64 KiB-granularity bitmap.
#
#   benches/bitmaps.sh                 # about 6 minutes on 2 cores
#   REPS=5 COUNT=20000 benches/bitmaps.sh
#
# Rows:
#   alloc    allocating writes, one per 64 KiB cluster (-S 64k), to a fresh extended-L2 overlay
#            of a 2 GiB raw file: every request dirties a new granule
#   stride   in-place writes to a fully written 2 GiB image with a stride of 7 MiB + 4 KiB
#            (-S 7344128): every request dirties a new granule far from the last one (the
#            worst case for marks ahead)
#   seq      in-place sequential writes (-S 4k) to the same image: one new granule every 16
#            requests
# Every cell is the best of REPS runs; the runs of a row alternate between the four
# configurations. Columns: IOPS of each, then crash-consistent / no bitmap,
# crash-consistent / qemu mode, and qimg crash-consistent / qemu-img with the bitmap.
#
# Environment: QIMG (default: cargo build --release), BENCH_DIR (default: a fresh directory
# under ${TMPDIR:-/var/tmp}, removed at the end), REPS (3), COUNT (most requests a run, 30000),
# DEPTHS ("1 32").
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
REPS=${REPS:-3}
COUNT=${COUNT:-30000}
DEPTHS=${DEPTHS:-"1 32"}
if [[ -z "${QIMG:-}" ]]; then
    (cd "$here" && cargo build --release -q -p qimg-cli)
    QIMG=$here/target/release/qimg
fi
if [[ $QIMG == */* ]]; then QIMG=$(realpath "$QIMG"); fi
dir=${BENCH_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/qimg-bitmaps.XXXXXX")}
cd "$dir"
cleanup() { rm -f full.raw full.qcow2 ov.qcow2 .run.out .run.err; [[ -n "${BENCH_DIR:-}" ]] || rmdir "$dir" 2>/dev/null || true; }
trap cleanup EXIT
log() { echo "$*" >&2; }

size=2G
qemu-img create -q -f qcow2 -o cluster_size=64k full.qcow2 $size
qemu-img bench -w -c 32768 -s 64k -d 16 --pattern 0x5a full.qcow2 >/dev/null
qemu-img convert -f qcow2 -O raw full.qcow2 full.raw
sync

# iops KIND ARGS...: IOPS of one run (0 if it failed).
iops() {
    local kind=$1
    shift
    case $kind in
        qimg)
            "$QIMG" bench --output json "$@" >.run.out 2>.run.err || { echo 0; return; }
            awk '/^  "iops":/ { gsub(/[",]/, "", $2); printf "%.0f\n", $2 }' .run.out
            ;;
        qemu)
            qemu-img bench "$@" >.run.out 2>.run.err || { echo 0; return; }
            awk '/^Sending/ { n = $2 } /^Run completed in/ { s = $4 }
                END { printf "%.0f\n", (s > 0 ? n / s : 0) }' .run.out
            ;;
    esac
}

# image ROW BITMAP: makes the row's image (with or without the bitmap); prints its name.
image() {
    local row=$1 bitmap=$2 f
    if [[ $row == alloc ]]; then
        f=ov.qcow2
        rm -f $f
        qemu-img create -q -f qcow2 -b full.raw -F raw -o cluster_size=64k,extended_l2=on $f $size
    else
        f=full.qcow2
        # Drop the bitmap of the previous run, if any.
        qemu-img bitmap --remove $f b0 2>/dev/null || true
    fi
    if [[ $bitmap == 1 ]]; then qemu-img bitmap --add $f b0; fi
    sync
    echo $f
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }

rows=()
for row in alloc stride seq; do
    case $row in
        alloc) step=64k ;;
        stride) step=7344128 ;;
        seq) step=4k ;;
    esac
    for qd in $DEPTHS; do
        declare -A best=([none]=0 [qemu]=0 [cc]=0 [qemuimg]=0)
        for ((rep = 0; rep < REPS; rep++)); do
            for cfg in none qemu cc qemuimg; do
                bitmap=1
                [[ $cfg == none ]] && bitmap=0
                f=$(image $row $bitmap)
                a=(-w -c "$COUNT" -d "$qd" -S "$step" --pattern 0xc3 -i io_uring -t none -f qcow2)
                case $cfg in
                    none | cc) v=$(iops qimg "${a[@]}" $f) ;;
                    qemu) v=$(iops qimg "${a[@]}" --bitmaps qemu $f) ;;
                    qemuimg) v=$(iops qemu "${a[@]}" $f) ;;
                esac
                ((v > best[$cfg])) && best[$cfg]=$v
            done
        done
        log "$row QD$qd: none ${best[none]}, qemu mode ${best[qemu]}, crash-consistent ${best[cc]}, qemu-img ${best[qemuimg]}"
        rows+=("| $row | $qd | ${best[none]} | ${best[qemu]} | ${best[cc]} | ${best[qemuimg]} | $(ratio "${best[cc]}" "${best[none]}") | $(ratio "${best[cc]}" "${best[qemu]}") | $(ratio "${best[cc]}" "${best[qemuimg]}") |")
    done
done
echo
echo "4 KiB writes, -t none -i io_uring, IOPS, best of $REPS runs of at most $COUNT requests"
echo
echo "| row | QD | qimg, no bitmap | qimg, bitmap (qemu mode) | qimg, bitmap (crash-consistent) | qemu-img, bitmap | cc / none | cc / qemu mode | cc / qemu-img |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo
echo "* $(nproc) cores, $(uname -sr), scratch on $(df -T . | awk 'NR == 2 { print $2 }'); $(qemu-img --version | head -1); qimg at $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
