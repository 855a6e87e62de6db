#!/usr/bin/env bash
# qimg bench vs qemu-img bench vs fio, side by side on the same images, as ratios.
#
#   benches/compare.sh            # everything, in well under 10 minutes on 2 cores
#   REPS=5 SEQ_COUNT=500000 benches/compare.sh
#   ROWS="a d" benches/compare.sh  # only some row groups (a b c d)
#
# Rows:
#   a  sequential 4 KiB reads of a fully written 1 GiB image (64 KiB clusters, whole L2
#      cache), threads and io_uring backends
#   b  large-stride 4 KiB reads with the smallest L2 cache (two entries), l2-cache-entry-size
#      4 KiB and 64 KiB: on the 1 GiB image (stride 32 MiB + 64 KiB), and on a 16 GiB
#      metadata-preallocated image (stride 512 MiB + 64 KiB, every request misses)
#   c  allocating 4 KiB writes (one per cluster) to an empty overlay over the full 1 GiB
#      image, extended_l2 off and on, clusters of 64 KiB, 128 KiB and 2 MiB; the overlay
#      (and fio's raw file) is made afresh before every run
#   d  random 4 KiB reads at queue depth 32 of the full image, whole L2 cache, on io_uring:
#      qimg vs fio (ioengine=io_uring, iodepth=32) on the raw file, buffered and O_DIRECT
#      (qemu-img bench has no random mode)
#
# Columns: IOPS of qimg bench on the qcow2 image, of qemu-img bench on the same image with
# the same options, their ratio (> 1: qimg is faster), IOPS of qimg bench -f raw and of fio on
# a raw copy (the baseline of the storage itself), qimg / fio, and what qimg's JSON report
# says about the run (L2 hit rate, bytes copied on write). Each cell is the best of REPS runs
# (the machine is shared; interference only ever slows a run down), 3 * REPS runs for rows of
# fewer than 5000 requests (the 2 MiB cluster writes: a 1 GiB disk has 512 such clusters).
#
# Environment: QIMG (binary; default: build target/release/qimg), BENCH_DIR (scratch
# directory; default a fresh one under ${TMPDIR:-/var/tmp}, removed at the end unless KEEP=1),
# REPS (3), SEQ_COUNT (200000), STRIDE_COUNT (50000), WRITE_COUNT (8000; at most one request
# per cluster of the 1 GiB disk), RAND_COUNT (200000), DIRECT_COUNT (50000), ROWS ("a b c d").
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
REPS=${REPS:-3}
SEQ_COUNT=${SEQ_COUNT:-200000}
STRIDE_COUNT=${STRIDE_COUNT:-50000}
WRITE_COUNT=${WRITE_COUNT:-8000}
RAND_COUNT=${RAND_COUNT:-200000}
DIRECT_COUNT=${DIRECT_COUNT:-50000}
ROWS=${ROWS:-"a b c d"}

for tool in qemu-img fio; do
    command -v "$tool" >/dev/null || { echo "compare.sh: $tool not found" >&2; exit 1; }
done
if [[ -z "${QIMG:-}" ]]; then
    (cd "$here" && cargo build --release -q -p qimg-cli)
    QIMG=$here/target/release/qimg
fi

dir=${BENCH_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/qimg-bench.XXXXXX")}
mkdir -p "$dir"
cleanup() { [[ "${KEEP:-0}" == 1 ]] || rm -rf "$dir"; }
trap cleanup EXIT
cd "$dir"

log() { echo "$*" >&2; }

# --- measurements: each prints "IOPS" (and qimg also "IOPS<TAB>note") -----------------

# qemu-img bench ARGS...: IOPS from "Run completed in X seconds." and the request count.
qemu_iops() {
    local out n secs
    out=$(qemu-img bench "$@")
    n=$(sed -n 's/^Sending \([0-9]*\) .*/\1/p' <<<"$out")
    secs=$(sed -n 's/^Run completed in \([0-9.]*\) seconds\./\1/p' <<<"$out")
    awk -v n="$n" -v s="$secs" 'BEGIN { printf "%.0f\n", (s > 0 ? n / s : 0) }'
}

# qimg bench ARGS...: IOPS and a note from the JSON report.
qimg_iops() {
    local out
    out=$("$QIMG" bench --output json "$@")
    awk '
        /"iops":/ { gsub(/[",]/, "", $2); iops = $2 }
        /"hit-rate":/ { gsub(/[",]/, "", $2); hit = $2 }
        /"cow-bytes":/ { gsub(/[",]/, "", $2); cow = $2 }
        END {
            note = (hit != "" ? sprintf("L2 hits %.1f%%", hit * 100) : "raw")
            printf "%.0f\t%s\t%s\n", iops, note, cow
        }' <<<"$out"
}

# fio OPTIONS...: IOPS (reads or writes, whichever the job did).
# The file stays in the page cache (fio would drop it before every job by default).
fio_iops() {
    fio --name=job --output-format=terse --terse-version=3 --invalidate=0 "$@" 2>/dev/null |
        awk -F';' '{ printf "%.0f\n", ($8 > 0 ? $8 : $49) }'
}

# best PREPARE CMD...: runs PREPARE (a shell snippet, may be ":") then CMD, REPS times
# (three times as often for short runs: fewer than 5000 requests), and prints the line with
# the highest first field.
best() {
    local prep=$1; shift
    local i line top="" topv=-1 v reps=$REPS
    if [[ " $* " =~ \ -c\ ([0-9]+)\  || " $* " =~ number_ios=([0-9]+) ]] && ((BASH_REMATCH[1] < 5000)); then
        reps=$((3 * REPS))
    fi
    for ((i = 0; i < reps; i++)); do
        eval "$prep"
        line=$("$@")
        v=${line%%$'\t'*}
        if awk -v a="$v" -v b="$topv" 'BEGIN { exit !(a > b) }'; then
            top=$line
            topv=$v
        fi
    done
    echo "$top"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "n/a" }'; }

rows=()
# row LABEL QIMG_LINE QEMU RAWQIMG FIO COUNT
row() {
    local label=$1 qline=$2 qemu=$3 raw=$4 fio=$5 count=$6
    local qimg note cow
    IFS=$'\t' read -r qimg note cow <<<"$qline"
    if [[ -n "${cow:-}" && "$cow" != "null" && "$cow" != 0 ]]; then
        note="${note:+$note, }COW $(awk -v c="$cow" -v n="$count" 'BEGIN { printf "%.1f", c / n / 1024 }') KiB/req"
    fi
    rows+=("| $label | $qimg | $qemu | $(ratio "$qimg" "$qemu") | $raw | $fio | $(ratio "$qimg" "$fio") | $note |")
    log "  $label: qimg $qimg, qemu-img $qemu, qimg raw $raw, fio $fio ($note)"
}

# --- images ------------------------------------------------------------------------------
log "images in $dir"
qemu-img create -q -f qcow2 -o cluster_size=64k full.qcow2 1G
qemu-img bench -q -w -c 16384 -s 64k -d 16 --pattern 0x5a full.qcow2 >/dev/null
qemu-img convert -O raw full.qcow2 full.raw
sync

# --- a: sequential reads ---------------------------------------------------------------
if [[ " $ROWS " == *" a "* ]]; then
    n=$SEQ_COUNT
    for aio in threads io_uring; do
        a=(-c "$n" -d 64 -i "$aio")
        q=$(best : qimg_iops "${a[@]}" full.qcow2)
        e=$(best : qemu_iops "${a[@]}" full.qcow2)
        r=$(best : qimg_iops "${a[@]}" -f raw full.raw)
        f=$(best : fio_iops --filename=full.raw --rw=read --bs=4k --iodepth=64 \
            --ioengine=io_uring --number_ios="$n")
        row "a: sequential 4 KiB reads, -i $aio" "$q" "$e" "${r%%$'\t'*}" "$f" "$n"
    done
fi

# --- b: large strides, small L2 cache ----------------------------------------------------
if [[ " $ROWS " == *" b "* ]]; then
    qemu-img create -q -f qcow2 -o cluster_size=64k,preallocation=metadata big.qcow2 16G
    n=$STRIDE_COUNT
    for img in full:33620k big:524352k; do
        IFS=: read -r name stride <<<"$img"
        for es in 4k 64k; do
            cs=$([[ $es == 4k ]] && echo 8k || echo 128k)
            opts="driver=qcow2,file.filename=$name.qcow2,l2-cache-size=$cs,l2-cache-entry-size=$es"
            a=(-c "$n" -S "$stride")
            q=$(best : qimg_iops "${a[@]}" --image-opts "$opts")
            e=$(best : qemu_iops "${a[@]}" --image-opts "$opts")
            if [[ $name == full ]]; then
                r=$(best : qimg_iops "${a[@]}" -f raw full.raw)
                # 4 KiB at the start of every stride-sized zone, wrapping at the end.
                f=$(best : fio_iops --filename=full.raw --rw=read --bs=4k --iodepth=64 \
                    --ioengine=io_uring --zonemode=strided --zonesize=4k \
                    --zonerange="$(numfmt --from=iec "${stride^^}")" --number_ios="$n")
                label="b: stride 32 MiB+64 KiB, 1 GiB full, entry $es, cache $cs"
            else
                r="-"
                f="-"
                label="b: stride 512 MiB+64 KiB, 16 GiB prealloc=metadata, entry $es, cache $cs"
            fi
            row "$label" "$q" "$e" "${r%%$'\t'*}" "$f" "$n"
        done
    done
    rm -f big.qcow2
fi

# --- c: allocating writes on an overlay --------------------------------------------------
if [[ " $ROWS " == *" c "* ]]; then
    for cs in 64k 128k 2M; do
        csb=$(numfmt --from=iec "${cs^^}")
        n=$(( WRITE_COUNT < 1073741824 / csb ? WRITE_COUNT : 1073741824 / csb ))
        for ext in off on; do
            # sync: the previous run's dirty pages are not written back during this one.
            mk="rm -f ov.qcow2; qemu-img create -q -f qcow2 -b full.qcow2 -F qcow2 -o cluster_size=$cs,extended_l2=$ext ov.qcow2; sync"
            a=(-w -c "$n" -S "$cs" --pattern 0xc3)
            q=$(best "$mk" qimg_iops "${a[@]}" ov.qcow2)
            e=$(best "$mk" qemu_iops "${a[@]}" ov.qcow2)
            if [[ $ext == off ]]; then
                mkraw="rm -f ov.raw; truncate -s 1G ov.raw; sync"
                r=$(best "$mkraw" qimg_iops "${a[@]}" -f raw ov.raw)
                f=$(best "$mkraw" fio_iops --filename=ov.raw --rw=write:$(( csb - 4096 )) --bs=4k \
                    --iodepth=64 --ioengine=io_uring --number_ios="$n")
            else
                r="(above)"
                f="(above)"
            fi
            row "c: 4 KiB allocating writes, cluster $cs, extended_l2=$ext" "$q" "$e" "${r%%$'\t'*}" "$f" "$n"
        done
    done
    rm -f ov.qcow2 ov.raw
fi

# --- d: random reads at depth 32 ---------------------------------------------------------
if [[ " $ROWS " == *" d "* ]]; then
    for direct in 0 1; do
        if [[ $direct == 0 ]]; then n=$RAND_COUNT; t=writeback; else n=$DIRECT_COUNT; t=none; fi
        a=(-c "$n" -d 32 --random --seed 1 -i io_uring -t "$t")
        q=$(best : qimg_iops "${a[@]}" full.qcow2)
        r=$(best : qimg_iops "${a[@]}" -f raw full.raw)
        f=$(best : fio_iops --filename=full.raw --rw=randread --bs=4k --iodepth=32 \
            --ioengine=io_uring --direct=$direct --norandommap --randrepeat=0 --number_ios="$n")
        row "d: random 4 KiB reads, depth 32, io_uring, -t $t (fio direct=$direct)" "$q" "-" "${r%%$'\t'*}" "$f" "$n"
    done
fi

# --- report -------------------------------------------------------------------------------
echo
echo "qimg bench vs qemu-img bench vs fio: IOPS, best of $REPS; ratios > 1 mean qimg is faster"
echo
echo "| row | qimg | qemu-img | qimg / qemu-img | qimg raw | fio raw | qimg / fio | qimg report |"
echo "|---|---:|---:|---:|---:|---:|---:|---|"
printf '%s\n' "${rows[@]}"
echo
echo "machine: $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $(uname -sr)," \
    "$(free -g | awk '/^Mem:/ { print $2 " GiB RAM" }'), scratch on $(df -T . | awk 'NR == 2 { print $2 }')"
echo "tools: $(qemu-img --version | head -1), $(fio --version), qimg $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
