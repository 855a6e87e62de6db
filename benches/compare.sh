#!/usr/bin/env bash
# qimg against qemu-img on the same images and the same command lines, in the configuration
# VMMs use first: O_DIRECT (-t none), then buffered (-t writeback), with the raw file as the
# baseline of the storage and the CPU time each tool spends per request.
#
#   benches/compare.sh                      # everything: about 8 minutes on 2 cores
#   REPS=5 benches/compare.sh
#   ROWS="a d" CACHES=none DEPTHS=32 benches/compare.sh    # some rows only
#   REPS=1 READ_COUNT=4000 DIRECT_COUNT=1000 WRITE_COUNT=200 IMG_SIZE=256M BIG_SIZE=512M \
#       CONVERT_SIZE=64M benches/compare.sh # a smoke test of every row (~20 s)
#
# Every request is 4 KiB on io_uring (-i io_uring). Every read and write row runs at queue
# depth 1 and 32 (-d 1, -d 32), each first with -t none (O_DIRECT) and then with
# -t writeback (buffered; the image files are read once beforehand, so they are in the page
# cache). Rows (sizes are the defaults):
#   a  strided reads of a fully written 2 GiB image (64 KiB clusters; the default L2 cache
#      holds every table) with a stride of 7 MiB + 4 KiB (-S 7344128), which walks every 4 KiB
#      block of the disk before it comes back to one (qemu-img bench has no random mode, so
#      both tools get this stride): qimg and qemu-img on the qcow2 image, and both with -f raw
#      on a raw copy of it
#   b  strided reads of a 4 GiB preallocation=metadata image (64 KiB clusters, 512 KiB of L2
#      tables; its data reads as zeros without touching the disk, so the metadata path is what
#      is measured) with 4 KiB slices (--image-opts driver=qcow2,file.filename=big.qcow2,
#      l2-cache-size=SIZE,l2-cache-entry-size=4k): a cache of 25% of the tables (128 KiB) at a
#      stride of 7 MiB + 4 KiB, and a 2-slice cache (8 KiB) at 33 MiB + 4 KiB, where every
#      request misses (at 4 GiB: a 512 MiB image has 16 slices, so QD32 finds a few hits);
#      qimg vs qemu-img
#   c  allocating writes, one per cluster (-w -S CLUSTER --pattern 0xc3), to a fresh overlay
#      of the 2 GiB raw file (qemu-img create -f qcow2 -b full.raw -F raw -o
#      cluster_size=CLUSTER,extended_l2=on ov.qcow2, made and followed by a sync before every
#      run): clusters of 64 KiB, 128 KiB and 2 MiB, and extended_l2=off at 64 KiB; at most
#      WRITE_COUNT requests, and at most one per cluster of the disk (1024 for 2 MiB); the raw
#      baseline is the same writes with -f raw on a fresh sparse raw file of the same size
#   d  random reads (qimg bench --random --seed 1) of the 2 GiB image: qimg on the qcow2 image
#      vs qimg -f raw on the raw copy (the goal: at least 0.8x, buffered at QD32), and fio
#      (--ioengine=io_uring --rw=randread, --direct=1 or --invalidate=0) on the raw copy when
#      fio is installed
#   e  qimg convert vs qemu-img convert of a 1 GiB qcow2 image (half base64 text, a quarter
#      random bytes, a quarter unallocated) to raw (-O raw), to raw with copy offloading
#      (-C -O raw: copy_file_range), to qcow2 (-O qcow2) and to compressed qcow2
#      (-c -O qcow2), with each tool's default cache modes and a `sync OUT` (fsync of the
#      output, not of the whole machine's dirty pages) timed after it
#      (qemu-img's output cache mode defaults to unsafe, qimg's to writeback: the sync makes
#      the two comparable); the source is in the page cache
#
# Columns: IOPS of qimg on the qcow2 image and of qemu-img with the same options, their ratio
# (> 1: qimg is faster), IOPS on the raw file of qimg -f raw, qemu-img -f raw and fio (the
# storage alone; "-" where the row has none), qimg on qcow2 / qimg on raw, the CPU time per
# request of qimg and of qemu-img on the qcow2 image (user + sys of the whole process, every
# thread, from bash's `time`, divided by the requests; it includes opening and closing the
# image, ~5 ms, and the kernel counts CPU time in ticks of a few ms, both small against the
# default counts but not against a smoke test's), and qimg's JSON report (L2 hit rate, bytes
# copied on write per request). Row e reports seconds instead: wall time of convert + sync,
# the ratio is qemu-img's time / qimg's time (> 1: qimg is faster), the CPU columns are the
# tools' user + sys seconds, and the report gives the output's allocated size.
#
# Each cell is the best of REPS runs (3 * REPS for rows of fewer than 5000 requests), and its
# CPU figure is that run's. The runs of a row alternate: in each repetition qimg, qemu-img,
# qimg raw, qemu-img raw and fio run in turn, so interference on a shared machine (which only
# ever slows a run down) hits them alike.
#
# Environment:
#   QIMG          the qimg binary (default: cargo build --release, target/release/qimg)
#   BENCH_DIR     scratch directory (default: a fresh one, removed at the end, under
#                 ${TMPDIR:-/var/tmp}); only the files the script makes there are removed
#   KEEP          1: keep what is left at the end (full.qcow2 and full.raw; the other images
#                 are removed when their rows are done)
#   REPS          runs per cell (3)
#   ROWS          row groups to run ("a b c d e")
#   CACHES        cache modes of the read and write rows ("none writeback")
#   DEPTHS        queue depths of the read and write rows ("1 32")
#   AIO           -i of every bench run (io_uring)
#   READ_COUNT    requests of a buffered read run (200000)
#   DIRECT_COUNT  requests of an O_DIRECT read run (30000; this virtual disk does ~15k IOPS at
#                 QD1)
#   WRITE_COUNT   most requests of a write run (8000)
#   IMG_SIZE      the fully written image, its raw copy and the overlays of c (2G)
#   BIG_SIZE      the preallocation=metadata image of b (4G; the 25% cache scales with it)
#   CONVERT_SIZE  the source image of e (1G)
#   BITMAP        1: the images of rows a, c and d carry one enabled persistent dirty bitmap
#                 (qemu-img bitmap --add, 64 KiB granularity), which every write of c marks
#                 (the cost of changed-block tracking); 0 (default): none
#   QIMG_POLL     microseconds qimg's queue watches its ring before it sleeps (qimg bench
#                 --poll; default 0, as qemu-img bench, whose main loop does not poll)
set -euo pipefail
export LC_ALL=C

here=$(cd "$(dirname "$0")/.." && pwd)
REPS=${REPS:-3}
ROWS=${ROWS:-"a b c d e"}
CACHES=${CACHES:-"none writeback"}
DEPTHS=${DEPTHS:-"1 32"}
AIO=${AIO:-io_uring}
READ_COUNT=${READ_COUNT:-200000}
DIRECT_COUNT=${DIRECT_COUNT:-30000}
WRITE_COUNT=${WRITE_COUNT:-8000}
IMG_SIZE=${IMG_SIZE:-2G}
BIG_SIZE=${BIG_SIZE:-4G}
CONVERT_SIZE=${CONVERT_SIZE:-1G}
BITMAP=${BITMAP:-0}

STRIDE=$((7 * 1048576 + 4096))      # walks every 4 KiB block (gcd with 2^n sizes: 4 KiB)
MISS_STRIDE=$((33 * 1048576 + 4096)) # more than one 4 KiB slice (512 entries: 32 MiB) apart

started=$SECONDS
bytes() { numfmt --from=iec "${1^^}"; }
# stride BYTES: "7 MiB + 4 KiB"
stride() { echo "$(($1 / 1048576)) MiB + $(($1 % 1048576 / 1024)) KiB"; }
# human BYTES: "2 GiB", "7172 KiB" (the largest unit that divides it)
human() {
    awk -v b="$1" 'BEGIN {
        split("B KiB MiB GiB TiB", u, " "); i = 1
        while (b >= 1024 && b % 1024 == 0 && i < 5) { b /= 1024; i++ }
        printf "%d %s", b, u[i] }'
}
log() { echo "$*" >&2; }
want() { [[ " $ROWS " == *" $1 "* ]]; }

img_bytes=$(bytes "$IMG_SIZE")
big_bytes=$(bytes "$BIG_SIZE")
conv_bytes=$(bytes "$CONVERT_SIZE")

command -v qemu-img >/dev/null || { echo "compare.sh: qemu-img not found" >&2; exit 1; }
have_fio=0
if command -v fio >/dev/null; then have_fio=1; fi
if [[ -z "${QIMG:-}" ]]; then
    (cd "$here" && cargo build --release -q -p qimg-cli)
    QIMG=$here/target/release/qimg
fi
QIMG=$(realpath "$QIMG")

if [[ -n "${BENCH_DIR:-}" ]]; then
    dir=$BENCH_DIR
    mkdir -p "$dir"
    own_dir=0
else
    dir=$(mktemp -d "${TMPDIR:-/var/tmp}/qimg-bench.XXXXXX")
    own_dir=1
fi
made=(full.qcow2 full.raw big.qcow2 conv.raw conv.qcow2 ov.qcow2 ov.raw out.raw out.qcow2
    .run.out .run.err .run.time)
cleanup() {
    [[ "${KEEP:-0}" == 1 ]] && return
    if ((own_dir)); then rm -rf "$dir"; else (cd "$dir" && rm -f -- "${made[@]}"); fi
}
trap cleanup EXIT
cd "$dir"

# --- one run -----------------------------------------------------------------------------

# measure KIND ARGS...: one run of `qimg bench --output json ARGS` (qimg), `qemu-img bench
# ARGS` (qemu) or `fio ARGS` (fio). Sets M_IOPS (an integer; 0 if the run failed), M_CPU (user
# + sys microseconds per request, "-" for fio), M_HIT (qimg's L2 hit rate) and M_COW (qimg's
# bytes copied on write).
measure() {
    local kind=$1
    shift
    local -a cmd
    case $kind in
        qimg) cmd=("$QIMG" bench --output json ${QIMG_POLL:+--poll "$QIMG_POLL"} "$@") ;;
        qemu) cmd=(qemu-img bench "$@") ;;
        fio) cmd=(fio --name=job --output-format=terse --terse-version=3 "$@") ;;
    esac
    local TIMEFORMAT='%3U %3S' user sys n="" secs
    M_IOPS=0 M_CPU=- M_HIT="" M_COW=""
    if ! { time "${cmd[@]}" >.run.out 2>.run.err; } 2>.run.time; then
        log "    failed: ${cmd[*]}"
        sed 's/^/    /' .run.err >&2
        return 0
    fi
    read -r user sys <.run.time
    case $kind in
        qimg)
            IFS=$'\t' read -r M_IOPS n M_HIT M_COW < <(awk '
                /^  "iops":/ { gsub(/[",]/, "", $2); iops = $2 }
                /^  "requests":/ { gsub(/[",]/, "", $2); n = $2 }
                /"hit-rate":/ { gsub(/[",]/, "", $2); hit = $2 }
                /^  "cow-bytes":/ { gsub(/[",]/, "", $2); cow = $2 }
                END { printf "%.0f\t%s\t%s\t%s\n", iops, n, hit, cow }' .run.out)
            ;;
        qemu)
            n=$(sed -n 's/^Sending \([0-9]*\) .*/\1/p' .run.out)
            secs=$(sed -n 's/^Run completed in \([0-9.]*\) seconds\./\1/p' .run.out)
            M_IOPS=$(awk -v n="$n" -v s="$secs" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
            ;;
        fio)
            M_IOPS=$(awk -F';' '{ printf "%.0f", ($8 > 0 ? $8 : $49) }' .run.out)
            ;;
    esac
    if [[ -n "$n" ]]; then
        M_CPU=$(awk -v u="$user" -v s="$sys" -v n="$n" 'BEGIN { printf "%.1f", (u + s) * 1e6 / n }')
    fi
}

# --- one row -------------------------------------------------------------------------------

# The row being measured: the arguments of each of its commands (an empty array: not in this
# row), and what runs before every run on the qcow2 image (PREP) and on the raw file
# (PREP_RAW).
A_QIMG=() A_QEMU=() A_QIMGRAW=() A_QEMURAW=() A_FIO=()
PREP=(:) PREP_RAW=(:)
declare -A B_IOPS=() B_CPU=() B_HIT=() B_COW=()

# try SLOT KIND ARGS...: one run, kept in slot SLOT if it is the slot's best so far.
try() {
    local slot=$1
    shift
    measure "$@"
    if [[ -z "${B_IOPS[$slot]:-}" ]] || ((M_IOPS > B_IOPS[$slot])); then
        B_IOPS[$slot]=$M_IOPS B_CPU[$slot]=$M_CPU B_HIT[$slot]=$M_HIT B_COW[$slot]=$M_COW
    fi
}

# run_row COUNT: REPS rounds (3 * REPS under 5000 requests) of the row's commands in turn.
run_row() {
    local n=$1 rep reps=$REPS
    ((n >= 5000)) || reps=$((3 * REPS))
    B_IOPS=() B_CPU=() B_HIT=() B_COW=()
    for ((rep = 0; rep < reps; rep++)); do
        if ((${#A_QIMG[@]})); then "${PREP[@]}"; try qimg qimg "${A_QIMG[@]}"; fi
        if ((${#A_QEMU[@]})); then "${PREP[@]}"; try qemu qemu "${A_QEMU[@]}"; fi
        if ((${#A_QIMGRAW[@]})); then "${PREP_RAW[@]}"; try qimgraw qimg "${A_QIMGRAW[@]}"; fi
        if ((${#A_QEMURAW[@]})); then "${PREP_RAW[@]}"; try qemuraw qemu "${A_QEMURAW[@]}"; fi
        if ((${#A_FIO[@]})); then "${PREP_RAW[@]}"; try fio fio "${A_FIO[@]}"; fi
    done
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else printf "n/a" }'; }

rows=()
# cell SLOT: the slot's best IOPS, "-" if the row has no such command, "failed" if every run
# failed.
cell() {
    local v=${B_IOPS[$1]:-}
    if [[ -z "$v" ]]; then echo -; elif ((v == 0)); then echo failed; else echo "$v"; fi
}

# emit LABEL QD CACHE COUNT: the table line of the row just run.
emit() {
    local label=$1 qd=$2 cache=$3 n=$4
    local q e qr er f note="" hit=${B_HIT[qimg]:-} cow=${B_COW[qimg]:-}
    q=$(cell qimg) e=$(cell qemu) qr=$(cell qimgraw) er=$(cell qemuraw) f=$(cell fio)
    if [[ -n "$hit" && "$hit" != null ]]; then
        note=$(awk -v h="$hit" 'BEGIN { printf "L2 hits %.1f%%", h * 100 }')
    fi
    if [[ -n "$cow" && "$cow" != null && "$cow" != 0 ]]; then
        note="${note:+$note, }COW $(awk -v c="$cow" -v n="$n" 'BEGIN { printf "%.1f", c / n / 1024 }') KiB/req"
    fi
    rows+=("| $label | $qd | $cache | $q | $e | $(ratio "$q" "$e") | $qr | $er | $f | $(ratio "$q" "$qr") | ${B_CPU[qimg]:--} | ${B_CPU[qemu]:--} | $note |")
    log "  QD$qd -t $cache: qimg $q (${B_CPU[qimg]:--} us/req), qemu-img $e (${B_CPU[qemu]:--} us/req)," \
        "qimg raw $qr (${B_CPU[qimgraw]:--} us/req), qemu-img raw $er (${B_CPU[qemuraw]:--} us/req), fio $f${note:+; $note}"
}

count_for() { if [[ $1 == none ]]; then echo "$DIRECT_COUNT"; else echo "$READ_COUNT"; fi; }
# warm KEY FILES...: puts FILES into the page cache the same way, once for each KEY (O_DIRECT
# runs do not evict them): each file is synced, dropped from the cache (`dd iflag=nocache
# count=0` advises POSIX_FADV_DONTNEED for the whole file) and read back whole by `cat`. What
# wrote a file decides how its cache pages are laid out (qemu-img bench's 64 KiB writes left
# small folios, convert's large writes large ones), and a lookup in a file cached in small
# folios costs the kernel more: without this, buffered reads of the qcow2 image paid ~0.4 µs
# per request more in the kernel than reads of its raw copy (xas_load 18 % of the qcow2 run's
# samples against 4 %), which no image format can help.
declare -A warmed=()
warm() {
    local key=$1 f
    shift
    if [[ -z "${warmed[$key]:-}" ]]; then
        sync -- "$@"
        for f in "$@"; do dd if="$f" iflag=nocache count=0 status=none; done
        cat -- "$@" >/dev/null
    fi
    warmed[$key]=1
}
clear_row() { A_QIMG=() A_QEMU=() A_QIMGRAW=() A_QEMURAW=() A_FIO=() PREP=(:) PREP_RAW=(:); }

# --- images --------------------------------------------------------------------------------
with_bitmap=""
if [[ $BITMAP == 1 ]]; then with_bitmap=", one enabled bitmap"; fi
log "images in $dir"
if want a || want c || want d; then
    qemu-img create -q -f qcow2 -o cluster_size=64k full.qcow2 "$img_bytes"
    qemu-img bench -w -c $((img_bytes / 65536)) -s 64k -d 16 --pattern 0x5a full.qcow2 >/dev/null
    qemu-img convert -f qcow2 -O raw full.qcow2 full.raw
    if [[ $BITMAP == 1 ]]; then qemu-img bitmap --add full.qcow2 b0; fi
    sync
fi

# --- a: strided reads, whole L2 cached -----------------------------------------------------
if want a; then
    label="a: reads, stride $(stride "$STRIDE"), $(human "$img_bytes") written image$with_bitmap"
    log "$label"
    for qd in $DEPTHS; do
        for cache in $CACHES; do
            [[ $cache == none ]] || warm full full.qcow2 full.raw
            n=$(count_for "$cache")
            a=(-c "$n" -d "$qd" -S "$STRIDE" -i "$AIO" -t "$cache")
            clear_row
            A_QIMG=("${a[@]}" -f qcow2 full.qcow2)
            A_QEMU=("${A_QIMG[@]}")
            A_QIMGRAW=("${a[@]}" -f raw full.raw)
            A_QEMURAW=("${A_QIMGRAW[@]}")
            run_row "$n"
            emit "$label" "$qd" "$cache" "$n"
        done
    done
fi

# --- b: strided reads, small L2 caches of 4 KiB slices -------------------------------------
if want b; then
    qemu-img create -q -f qcow2 -o cluster_size=64k,preallocation=metadata big.qcow2 "$big_bytes"
    sync
    # 25% of the L2 tables (8 bytes per 64 KiB cluster), in whole 4 KiB slices, at least two.
    l2_quarter=$((big_bytes / 32768))
    l2_quarter=$((l2_quarter - l2_quarter % 4096))
    ((l2_quarter >= 8192)) || l2_quarter=8192
    for cfg in "$l2_quarter:$STRIDE:25% of the tables" "8192:$MISS_STRIDE:2 slices"; do
        IFS=: read -r l2 stride what <<<"$cfg"
        label="b: reads, stride $(stride "$stride"), $(human "$big_bytes") prealloc=metadata, L2 cache $(human "$l2") ($what), 4 KiB slices"
        log "$label"
        opts="driver=qcow2,file.filename=big.qcow2,l2-cache-size=$l2,l2-cache-entry-size=4k"
        for qd in $DEPTHS; do
            for cache in $CACHES; do
                [[ $cache == none ]] || warm big big.qcow2
                n=$(count_for "$cache")
                clear_row
                A_QIMG=(-c "$n" -d "$qd" -S "$stride" -i "$AIO" -t "$cache" --image-opts "$opts")
                A_QEMU=("${A_QIMG[@]}")
                run_row "$n"
                emit "$label" "$qd" "$cache" "$n"
            done
        done
    done
    rm -f big.qcow2
fi

# --- c: allocating writes on a fresh overlay of a raw file ---------------------------------
# sync: the previous run's dirty pages are not written back during this one.
new_overlay() {
    rm -f ov.qcow2
    qemu-img create -q -f qcow2 -b full.raw -F raw -o "cluster_size=$1,extended_l2=$2" ov.qcow2
    if [[ $BITMAP == 1 ]]; then qemu-img bitmap --add ov.qcow2 b0; fi
    sync
}
new_raw() { rm -f ov.raw; truncate -s "$img_bytes" ov.raw; sync; }
if want c; then
    for cfg in 64k:on 64k:off 128k:on 2M:on; do
        IFS=: read -r cs ext <<<"$cfg"
        csb=$(bytes "$cs")
        n=$((WRITE_COUNT < img_bytes / csb ? WRITE_COUNT : img_bytes / csb))
        label="c: allocating writes, one per $(human "$csb") cluster, extended_l2=$ext, over raw$with_bitmap"
        log "$label"
        for qd in $DEPTHS; do
            for cache in $CACHES; do
                a=(-w -c "$n" -d "$qd" -S "$csb" --pattern 0xc3 -i "$AIO" -t "$cache")
                clear_row
                PREP=(new_overlay "$cs" "$ext") PREP_RAW=(new_raw)
                A_QIMG=("${a[@]}" -f qcow2 ov.qcow2)
                A_QEMU=("${A_QIMG[@]}")
                A_QIMGRAW=("${a[@]}" -f raw ov.raw)
                A_QEMURAW=("${A_QIMGRAW[@]}")
                run_row "$n"
                emit "$label" "$qd" "$cache" "$n"
            done
        done
    done
    rm -f ov.qcow2 ov.raw
fi

# --- d: random reads, qcow2 against the raw file --------------------------------------------
if want d; then
    label="d: random reads (qimg --random), $(human "$img_bytes") written image"
    log "$label"
    for qd in $DEPTHS; do
        for cache in $CACHES; do
            [[ $cache == none ]] || warm full full.qcow2 full.raw
            n=$(count_for "$cache")
            a=(-c "$n" -d "$qd" --random --seed 1 -i "$AIO" -t "$cache")
            clear_row
            A_QIMG=("${a[@]}" -f qcow2 full.qcow2)
            A_QIMGRAW=("${a[@]}" -f raw full.raw)
            if ((have_fio)); then
                # --invalidate=0: the file stays in the page cache (fio drops it by default).
                if [[ $cache == none ]]; then fc=--direct=1; else fc=--invalidate=0; fi
                A_FIO=(--filename=full.raw --rw=randread --bs=4k --iodepth="$qd" --ioengine=io_uring
                    "$fc" --norandommap --randrepeat=0 --number_ios="$n")
            fi
            run_row "$n"
            emit "$label" "$qd" "$cache" "$n"
        done
    done
fi

# --- e: convert ------------------------------------------------------------------------------
# convert_run TOOL OUT ARGS...: one `TOOL convert ARGS` (after removing OUT and a sync), timed
# with a `sync OUT` after it. Sets C_SECS (wall seconds, 0 if it failed), C_CPU (user + sys seconds
# of the tool alone) and C_MIB (OUT's allocated size).
convert_run() {
    local tool=$1 out=$2
    shift 2
    local TIMEFORMAT='%3U %3S' user sys t0 t1
    rm -f "$out"
    sync
    C_SECS=0 C_CPU=- C_MIB=-
    t0=$EPOCHREALTIME
    if ! { time "$tool" convert "$@" >.run.out 2>.run.err; } 2>.run.time; then
        log "    failed: $tool convert $*"
        sed 's/^/    /' .run.err >&2
        return 0
    fi
    sync -- "$out"
    t1=$EPOCHREALTIME
    read -r user sys <.run.time
    C_SECS=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
    C_CPU=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }')
    C_MIB=$(du -m "$out" | cut -f1)
}
if want e; then
    # Half base64 text (compresses to ~75%), a quarter random bytes, a quarter never written.
    half=$((conv_bytes / 2 / 65536 * 65536))
    quarter=$((conv_bytes / 4 / 65536 * 65536))
    rm -f conv.raw
    truncate -s "$conv_bytes" conv.raw
    dd if=<(base64 -w 0 /dev/urandom) of=conv.raw conv=notrunc bs=1M count="$half" \
        iflag=count_bytes,fullblock status=none
    dd if=/dev/urandom of=conv.raw conv=notrunc bs=1M count="$quarter" seek="$half" \
        iflag=count_bytes,fullblock oflag=seek_bytes status=none
    rm -f conv.qcow2
    qemu-img convert -f raw -O qcow2 conv.raw conv.qcow2
    rm -f conv.raw
    warm conv conv.qcow2
    for cfg in "raw:-O raw:out.raw" "raw with copy offloading (-C):-C -O raw:out.raw" \
        "qcow2:-O qcow2:out.qcow2" "compressed qcow2:-c -O qcow2:out.qcow2"; do
        IFS=: read -r what opts out <<<"$cfg"
        read -ra o <<<"$opts"
        label="e: convert $(human "$conv_bytes") qcow2 to $what (s, CPU s)"
        log "$label"
        declare -A best_s=() best_cpu=() best_mib=()
        for ((rep = 0; rep < REPS; rep++)); do
            for tool in "$QIMG" qemu-img; do
                convert_run "$tool" "$out" -f qcow2 "${o[@]}" conv.qcow2 "$out"
                if [[ -z "${best_s[$tool]:-}" || "${best_s[$tool]}" == 0 ]] ||
                    awk -v a="$C_SECS" -v b="${best_s[$tool]}" 'BEGIN { exit !(a > 0 && a < b) }'; then
                    best_s[$tool]=$C_SECS best_cpu[$tool]=$C_CPU best_mib[$tool]=$C_MIB
                fi
            done
        done
        rm -f "$out"
        qs=${best_s[$QIMG]} es=${best_s[qemu-img]}
        qc=failed ec=failed
        if [[ $qs != 0 ]]; then qc="$qs s"; fi
        if [[ $es != 0 ]]; then ec="$es s"; fi
        note="output: qimg ${best_mib[$QIMG]} MiB, qemu-img ${best_mib[qemu-img]} MiB"
        rows+=("| $label | - | default + sync | $qc | $ec | $(ratio "$es" "$qs") | - | - | - | n/a | ${best_cpu[$QIMG]} s | ${best_cpu[qemu-img]} s | $note |")
        log "  qimg $qc (CPU ${best_cpu[$QIMG]} s), qemu-img $ec (CPU ${best_cpu[qemu-img]} s); $note"
    done
    rm -f conv.qcow2
fi

# --- report ---------------------------------------------------------------------------------
echo
echo "qimg vs qemu-img, 4 KiB requests on -i $AIO: IOPS, best of $REPS runs; ratios > 1 mean qimg is faster"
echo
echo "| row | QD | cache | qimg | qemu-img | qimg / qemu-img | qimg raw | qemu-img raw | fio raw | qimg / qimg raw | qimg CPU µs/req | qemu-img CPU µs/req | qimg report |"
echo "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
if ((${#rows[@]})); then printf '%s\n' "${rows[@]}"; fi
echo
echo "* machine: $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $(uname -sr)," \
    "$(free -g | awk '/^Mem:/ { print $2 " GiB RAM" }'), scratch on $(df -T . | awk 'NR == 2 { print $2 }')"
fio_version=$( ((have_fio)) && fio --version || echo "fio not installed")
echo "* tools: $(qemu-img --version | head -1), $fio_version, $("$QIMG" --version) ($QIMG;" \
    "work tree at $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?'))"
echo "* settings: QIMG_POLL=${QIMG_POLL:-0} REPS=$REPS READ_COUNT=$READ_COUNT DIRECT_COUNT=$DIRECT_COUNT WRITE_COUNT=$WRITE_COUNT" \
    "IMG_SIZE=$IMG_SIZE BIG_SIZE=$BIG_SIZE CONVERT_SIZE=$CONVERT_SIZE BITMAP=$BITMAP ROWS=\"$ROWS\" CACHES=\"$CACHES\"" \
    "DEPTHS=\"$DEPTHS\" AIO=$AIO; ran in $((SECONDS - started)) s"
echo "* load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
