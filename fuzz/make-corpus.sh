#!/usr/bin/env bash
# Builds the seed corpus of every fuzz target from images qemu-img and qemu-io make:
#
#   header          the first 4 KiB of images of every kind (header, extensions, backing name)
#   l2_slice        one selector byte (geometry, see qimg_format::fuzz::l2_context) and the
#                   first 2 KiB of every L2 table of small images with data
#   refcount_block  one selector byte (order | (cluster_bits - 9) << 3) and the first 512
#                   bytes of the first refcount block, for every refcount width
#   open_read       whole small images (4 KiB clusters, 16 KiB with extended L2 entries): data,
#                   zero and discarded clusters, compressed clusters, snapshots, a dirty lazy
#                   refcounts image, bitmaps, version 2, every refcount width
#   check           some of the same images, plus copies of two with a refcount, a refcount
#                   table entry, an L2 entry or a subcluster bitmap damaged
#   ops             hand-written operation sequences (see qimg_testkit::fuzzing::decode_ops)
#
# Re-run after changing the lists; the output is committed so that `cargo test` replays it
# without qemu-img. Every corpus directory but header is emptied first.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"

# ---------------------------------------------------------------------------- header
out="$here/corpus/header"
mkdir -p "$out"
qemu-img create -q -f qcow2 base.qcow2 64M
qemu-img create -q -f raw base.raw 64M
n=0
make() { # name, then qemu-img create arguments
  local name=$1; shift
  rm -f img.qcow2 data.raw
  qemu-img create -q -f qcow2 "$@" img.qcow2 64M
  head -c 4096 img.qcow2 > "$out/$name"
  n=$((n + 1))
}
for cs in 512 4k 64k 2M; do make "cs$cs" -o cluster_size=$cs; done
for cs in 16k 128k 2M; do make "ext-cs$cs" -o extended_l2=on,cluster_size=$cs; done
make v2 -o compat=0.10
make v2-backing -o compat=0.10 -b base.qcow2 -F qcow2
for rb in 1 8 64; do make "rb$rb" -o refcount_bits=$rb; done
make lazy-zstd -o lazy_refcounts=on,compression_type=zstd
make backing -b base.qcow2 -F qcow2
make backing-raw -o extended_l2=on -b base.raw -F raw
make datafile -o data_file=data.raw
make datafile-raw -o data_file=data.raw,data_file_raw=on
rm -f img.qcow2; qemu-img create -q -f qcow2 img.qcow2 64M
qemu-img snapshot -c s1 img.qcow2
qemu-img bitmap --add img.qcow2 b0
head -c 4096 img.qcow2 > "$out/snapshot-bitmap"; n=$((n + 1))
echo "wrote $n seeds to $out"
rm -f img.qcow2 base.qcow2 base.raw data.raw

for t in l2_slice refcount_block open_read check ops; do
  rm -rf "${here:?}/corpus/$t"
  mkdir -p "$here/corpus/$t"
done

# Big-endian integers of a file: be64 FILE OFFSET, be32 FILE OFFSET.
be() { echo $((16#$(od -An -v -t x1 -j "$2" -N "$3" "$1" | tr -d ' \n'))); }
be64() { be "$1" "$2" 8; }
cut() { dd if="$1" iflag=skip_bytes,count_bytes skip="$2" count="$3" status=none; } # file, at, len
be32() { be "$1" "$2" 4; }
qio() { # image, then qemu-io commands
  local img=$1; shift
  local args=()
  for c in "$@"; do args+=(-c "$c"); done
  qemu-io -f qcow2 "${args[@]}" "$img" > /dev/null
}

# ---------------------------------------------------------------------------- images
img() { # name, size, create options, then qemu-io commands
  local name=$1 size=$2 opts=$3; shift 3
  qemu-img create -q -f qcow2 -o "$opts" "$name" "$size"
  if [ $# -gt 0 ]; then qio "$name" "$@"; fi
}
data=("write -P 0x11 0 12k" "write -P 0x22 20k 3k" "write -z 40k 8k" "write -P 0x33 300k 4k"
      "write -P 0x44 1032k 8k" "discard 4k 4k" "write -z 8k 4k")
img std4k 4M cluster_size=4k "${data[@]}"
img std8k-v2 2M cluster_size=8k,compat=0.10 "write -P 0x55 0 24k" "write -P 0x66 1M 8k" \
  "discard 8k 8k"
img ext16k 4M cluster_size=16k,extended_l2=on "write -P 0x11 0 3k" "write -P 0x22 5k 1k" \
  "write -z 16k 16k" "write -P 0x33 40k 512" "discard 1k 512" "write -z 2560 512" \
  "write -P 0x44 2M 4k"
img ext16k-rb4 2M cluster_size=16k,extended_l2=on,refcount_bits=4 "write -P 0x77 1k 2k" \
  "write -z 8k 1k"
for rb in 1 2 4 8 32 64; do
  img "rb$rb" 1M "cluster_size=4k,refcount_bits=$rb" "write -P $rb 0 8k" "write -P $((rb + 100)) 512k 4k"
done
# Compressed clusters (zlib and zstd), standard and extended.
img plain4k 1M cluster_size=4k "write -P 0x5a 0 64k" "write -P 0xa5 256k 16k"
qemu-img convert -c -O qcow2 -o cluster_size=4k plain4k comp4k
qemu-img convert -c -O qcow2 -o cluster_size=4k,compression_type=zstd plain4k comp4k-zstd
qemu-img convert -c -O qcow2 -o cluster_size=16k,extended_l2=on plain4k comp16k-ext
img compwrite4k 1M cluster_size=4k "write -c -P 0x12 0 4k" "write -c -P 0x34 8k 4k" \
  "write -P 0x56 4k 4k"
rm plain4k
# Internal snapshots: shared clusters (refcount 2), copied on write afterwards.
img snap4k 1M cluster_size=4k "write -P 0x11 0 16k"
qemu-img snapshot -c s1 snap4k
qio snap4k "write -P 0x22 4k 4k" "write -P 0x33 64k 4k"
qemu-img snapshot -c s2 snap4k
qio snap4k "discard 0 4k"
img snapext16k 1M cluster_size=16k,extended_l2=on "write -P 0x11 0 20k"
qemu-img snapshot -c s1 snapext16k
qio snapext16k "write -P 0x22 1k 1k"
# A dirty image (lazy refcounts, qemu-io aborts before writing refcounts back).
img lazy4k 1M cluster_size=4k,lazy_refcounts=on
(ulimit -c 0; qemu-io -f qcow2 -c "write -P 0x11 0 12k" -c flush -c "write -P 0x22 64k 8k" \
  -c abort lazy4k > /dev/null 2>&1) || true
# A persistent bitmap.
img bitmap4k 1M cluster_size=4k "write -P 0x11 0 8k"
qemu-img bitmap --add bitmap4k b0
qemu-img bitmap --enable bitmap4k b0
qio bitmap4k "write -P 0x22 64k 4k"
# Preallocated metadata (zero-allocated clusters after write -z), and a backing file name.
img prealloc4k 64k cluster_size=4k,preallocation=metadata "write -P 0x11 0 4k" "write -z 8k 8k"
qemu-img create -q -f qcow2 -o cluster_size=4k base4k 1M
img overlay4k 1M cluster_size=4k,backing_file=base4k,backing_fmt=qcow2 "write -P 0x11 4k 4k"
images=(std4k std8k-v2 ext16k ext16k-rb4 rb1 rb2 rb4 rb8 rb32 rb64 comp4k comp4k-zstd comp16k-ext
        compwrite4k snap4k snapext16k lazy4k bitmap4k prealloc4k overlay4k)

for i in "${images[@]}"; do cp "$i" "$here/corpus/open_read/$i"; done
checked=(std4k std8k-v2 ext16k rb1 rb64 comp4k compwrite4k snap4k lazy4k bitmap4k prealloc4k
         overlay4k)
for i in "${checked[@]}"; do cp "$i" "$here/corpus/check/$i"; done

# ---------------------------------------------------------------------------- l2_slice
# Every L2 table of the active L1 table and of the snapshots' L1 tables.
OFFSET_MASK=$((0x00fffffffffffe00))
slices=0
for i in "${images[@]}"; do
  cb=$(be32 "$i" 20)
  incompat=$(be64 "$i" 72)
  version=$(be32 "$i" 4)
  if (( version >= 3 && incompat & 16 )); then
    sel=$(( 1 | (cb - 14) << 1 ))
  else
    sel=$(( (cb - 9) << 1 ))
  fi
  (( version == 2 )) && sel=$(( sel | 0x40 ))
  l1s=("$(be64 "$i" 40):$(be32 "$i" 36)")
  nsnap=$(be32 "$i" 60)
  at=$(be64 "$i" 64)
  for ((s = 0; s < nsnap; s++)); do
    # Snapshot table entry: l1_table_offset (8), l1_size (4), id and name lengths, extra.
    l1s+=("$(be64 "$i" "$at"):$(be32 "$i" $((at + 8)))")
    idlen=$(be "$i" $((at + 12)) 2)
    namelen=$(be "$i" $((at + 14)) 2)
    extra=$(be32 "$i" $((at + 36)))
    at=$(( (at + 40 + extra + idlen + namelen + 7) / 8 * 8 ))
  done
  k=0
  for l1 in "${l1s[@]}"; do
    off=${l1%%:*} size=${l1##*:}
    for ((e = 0; e < size; e++)); do
      l2=$(( $(be64 "$i" $((off + e * 8))) & OFFSET_MASK ))
      (( l2 == 0 )) && continue
      f="$here/corpus/l2_slice/$i-$k"
      printf "\\x$(printf %02x "$sel")" > "$f"
      cut "$i" "$l2" 2048 >> "$f"
      k=$((k + 1)) slices=$((slices + 1))
    done
  done
done

# ---------------------------------------------------------------------------- refcount_block
blocks=0
for i in "${images[@]}"; do
  cb=$(be32 "$i" 20)
  version=$(be32 "$i" 4)
  order=4
  (( version >= 3 )) && order=$(be32 "$i" 96)
  rb=$(be64 "$i" "$(be64 "$i" 48)")
  sel=$(( order | (cb - 9) << 3 ))
  f="$here/corpus/refcount_block/$i"
  printf "\\x$(printf %02x "$sel")" > "$f"
  cut "$i" "$rb" 512 >> "$f"
  # The refcount table itself, as a table (order 6: 64-bit words).
  f="$here/corpus/refcount_block/$i-table"
  printf "\\x$(printf %02x $(( 6 | (cb - 9) << 3 )))" > "$f"
  cut "$i" "$(be64 "$i" 48)" 256 >> "$f"
  blocks=$((blocks + 2))
done

# ---------------------------------------------------------------------------- check (damaged)
poke() { # file, offset, hex bytes
  printf "$(printf '%s' "$3" | sed 's/../\\x&/g')" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
d="$here/corpus/check"
reftable=$(be64 std4k 48)
rb=$(be64 std4k "$reftable")
# Refcount of cluster 5 (16-bit refcounts): 0 (a corruption) and 7 (a leak).
cp std4k "$d/std4k-refcount-zero"; poke "$d/std4k-refcount-zero" $((rb + 10)) 0000
cp std4k "$d/std4k-refcount-leak"; poke "$d/std4k-refcount-leak" $((rb + 10)) 0007
# First L2 entry: reserved bits set; COPIED flag cleared; pointing past the end of the file.
l2=$(( $(be64 std4k "$(be64 std4k 40)") & OFFSET_MASK ))
entry=$(od -An -v -t x1 -j "$l2" -N 8 std4k | tr -d ' \n')
cp std4k "$d/std4k-l2-reserved"; poke "$d/std4k-l2-reserved" $((l2 + 7)) 02
cp std4k "$d/std4k-l2-not-copied"; poke "$d/std4k-l2-not-copied" "$l2" "0${entry:1:1}"
cp std4k "$d/std4k-l2-past-end"; poke "$d/std4k-l2-past-end" "$l2" 8000000100000000
# Extended L2 entry with both bits of a subcluster set.
l2=$(( $(be64 ext16k "$(be64 ext16k 40)") & OFFSET_MASK ))
cp ext16k "$d/ext16k-bitmap-both"; poke "$d/ext16k-bitmap-both" $((l2 + 8)) 00000001
# The refcount table entry of the only block cleared (needs a rebuild).
cp std4k "$d/std4k-no-refblock"; poke "$d/std4k-no-refblock" "$reftable" 0000000000000000
damaged=7

# ---------------------------------------------------------------------------- ops
# Shape bytes (see qimg_testkit::fuzzing::OpsShape), then 8-byte operations
# [kind, m, s1, s0, l, n1, n0, w]: kind%16 0-5 write, 6-7 zero, 8-10 discard, 11-12 read,
# 13-14 flush, 15 reopen.
o="$here/corpus/ops"
hex() { printf "$(printf '%s' "$*" | tr -d ' ' | sed 's/../\\x&/g')"; }
seq_a="00 00 0000 01 0010 00
       00 02 0003 02 0123 45
       06 01 0001 00 0000 00
       08 00 0002 01 0003 00
       0b 03 0000 03 0040 11
       0d 00 0000 00 0000 00
       0f 00 0000 00 0000 00
       01 03 0007 04 1234 99
       09 02 0005 02 0fff 10
       0c 00 0000 01 0027 00"
seq_b="00 00 0000 01 0027 00
       0e 00 0000 00 0000 00
       08 00 0010 01 0008 00
       07 00 0020 01 0008 00
       0f 00 0000 00 0000 00
       02 03 ffff 03 7777 ab
       0a 01 0040 00 0000 00
       0b 00 0000 01 0027 00"
seq_c="05 03 0001 02 0007 01
       06 03 0001 02 00ff 01
       08 03 0002 02 0100 02
       0f 00 0000 00 0000 00
       0b 03 0000 02 0fff 00"
n_ops=0
shape() { # name, shape bytes, sequence
  { hex "$2"; hex "$3"; } > "$o/$1"
  n_ops=$((n_ops + 1))
}
shape std4k-rb16 "20 00" "$seq_a"
shape std4k-small-cache "20 01" "$seq_a"
shape ext16k "23 00" "$seq_a"
shape ext16k-raw-backing "63 00" "$seq_a"
shape ext64k-qcow2-backing "a7 01" "$seq_b"
shape std64k-rb1-sparse "06 02" "$seq_b"
shape std32k-rb64-lazy "34 04" "$seq_b"
shape std4k-v2-raw-backing "40 08" "$seq_a"
shape ext32k-rb8-small "1d 05" "$seq_c"
shape std16k-rb2-qcow2-backing "8a 03" "$seq_c"

echo "wrote ${#images[@]} images to open_read and $(( ${#checked[@]} + damaged )) to check,"
echo "$slices L2 slices, $blocks refcount blocks and tables, $n_ops operation sequences"
du -sh "$here/corpus"
