#!/usr/bin/env bash
# Builds the seed corpus of the `header` fuzz target from images qemu-img makes: the first
# 4 KiB of each (header, extensions and backing name live there). Re-run after changing the
# list; the output is committed so that `cargo test` replays it without qemu-img.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/corpus/header"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
cd "$tmp"
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
