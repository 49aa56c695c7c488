#!/usr/bin/env bash
# Runs multihead-kernels' tests on an emulated Sapphire Rapids (AVX-512F,
# AVX512-BF16, AVX512-VNNI), for machines without those instructions: every
# instruction-set level the tests force then runs, `avx512bf16` included.
#
#   scripts/emulate-avx512bf16.sh [TEST_FILTER]   (default: every test)
#
# EMU_PACKAGE names another package whose library tests to run instead
# (default multihead-kernels), e.g. EMU_PACKAGE=multihead-attention with
# the filter `tiled` for the attention tiles on every level.
#
# What it uses, all from Debian's archive (no other network): Bochs 3.0's
# source (Debian trixie's pool; built here, ~10 minutes, with two fixes
# to its AVX512-BF16 decoding: VDPBF16PS's memory operand is a full vector,
# not a dword, for its 8-bit displacement, and VCVTNE2PS2BF16's upper half
# comes from the first source's low lanes), Debian's stock kernel,
# ISOLINUX, busybox-static and xorriso (unpacked, not installed). The test
# binary is linked statically and booted as the init of a RAM disk; its
# output comes back over the emulated serial port. Boot plus the whole
# suite takes 5 to 10 minutes on two cores. Work files go to $EMU_DIR (default
# /tmp/multihead-emu).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${EMU_DIR:-/tmp/multihead-emu}
filter=${1:-::}
package=${EMU_PACKAGE:-multihead-kernels}
mkdir -p "$work" && cd "$work"

# Debian packages, unpacked into deb/.
if [ ! -x deb/bin/busybox ]; then
  kernel=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*\)/\1/p' | head -1)
  apt-get download "$kernel" isolinux syslinux-common busybox-static vgabios \
    xorriso libisoburn1 libburn4 libisofs6 libjte2 >/dev/null
  for f in ./*.deb; do dpkg-deb -x "$f" deb; done
fi

# Bochs 3.0 with the two fixes.
bochs=$work/bochs-3.0/bochs
if [ ! -x "$bochs" ]; then
  curl -fsS -O http://deb.debian.org/debian/pool/main/b/bochs/bochs_3.0+dfsg.orig.tar.xz
  tar xf bochs_3.0+dfsg.orig.tar.xz
  (
    cd bochs-3.0
    sed -i '/BX_IA_EVEX_VDPBF16PS_VpsHdqWdq_Kmask/s/OP_Hdq, OP_mVdq32,/OP_Hdq, OP_mVdq,/' cpu/decoder/ia_opcodes_evex.def
    sed -i 's/convert_ne_fp32_to_bfloat16(op1.vmm32u(n));/convert_ne_fp32_to_bfloat16(op1.vmm32u(n - DWORD_ELEMENTS(len)));/' cpu/avx/avx512_bf16.cc
    grep -q 'OP_Hdq, OP_mVdq, OP_NONE, OP_NONE, BX_PREPARE_EVEX_NO_SAE)' cpu/decoder/ia_opcodes_evex.def
    grep -q 'n - DWORD_ELEMENTS(len)' cpu/avx/avx512_bf16.cc
    ./configure --enable-x86-64 --enable-avx --enable-evex --enable-cpu-level=6 \
      --enable-all-optimizations --with-nogui --disable-plugins --enable-pci \
      --disable-sound --disable-usb --enable-long-phy-address >configure.log
    make -j"$(nproc)" >make.log
  )
fi

# The static test binary.
(
  cd "$repo"
  RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$work/target" \
    cargo test -p "$package" --lib --release --no-run --target x86_64-unknown-linux-gnu 2>&1 | tail -1
)
tests=$(ls -t "$work"/target/x86_64-unknown-linux-gnu/release/deps/"${package//-/_}"-* | grep -v '\.d$' | head -1)

# The RAM disk: busybox, the tests, an init that runs them and powers off.
rm -rf initrd iso && mkdir -p initrd/{bin,proc,sys,dev,tmp} iso/isolinux
cp deb/bin/busybox initrd/bin/ && cp "$tests" initrd/bin/tests
cat >initrd/init <<'INIT'
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
echo "=== cpu: $(/bin/busybox grep -o -w -E 'avx512f|avx512_bf16|avx512_vnni' /proc/cpuinfo | /bin/busybox sort -u | /bin/busybox tr '\n' ' ')"
filter=$(/bin/busybox sed -n 's/.* tests=\([^ ]*\).*/\1/p' /proc/cmdline | /bin/busybox tr ',' ' ')
cd /tmp && /bin/tests --test-threads=1 $filter >/tmp/out 2>&1
echo "=== tests exit $?"
/bin/busybox cat /tmp/out
echo "=== end"
/bin/busybox sleep 5
/bin/busybox poweroff -f
INIT
chmod +x initrd/init
(cd initrd && ../deb/bin/busybox sh -c 'find . | ../deb/bin/busybox cpio -o -H newc 2>/dev/null') >iso/initrd.img
cp deb/boot/vmlinuz-* iso/vmlinuz
cp deb/usr/lib/ISOLINUX/isolinux.bin deb/usr/lib/syslinux/modules/bios/ldlinux.c32 iso/isolinux/
# ACPI off (Bochs' SMM return fails with this CPU model), and the CPUID
# features whose emulation stalls the kernel's boot hidden from it.
cat >iso/isolinux/isolinux.cfg <<CFG
DEFAULT emu
PROMPT 0
TIMEOUT 0
LABEL emu
  KERNEL /vmlinuz
  APPEND initrd=/initrd.img console=ttyS0,115200 loglevel=3 acpi=off lsm= no5lvl split_lock_detect=off tsx=off nopku idle=halt ibt=off lapic=notscdeadline clearcpuid=fsrm,umip,gfni,vaes,vpclmulqdq,waitpkg,movdiri,movdir64b,serialize,cldemote,rdpid,fsgsbase,erms,pcid,invpcid nokaslr mitigations=off tests=$filter
CFG
LD_LIBRARY_PATH=deb/usr/lib/x86_64-linux-gnu deb/usr/bin/xorriso -as mkisofs -quiet -o emu.iso \
  -b isolinux/isolinux.bin -c isolinux/boot.cat -no-emul-boot -boot-load-size 4 -boot-info-table iso

cat >bochsrc <<RC
megs: 512
cpu: model=sapphire_rapids, count=1, ips=100000000
romimage: file=$work/bochs-3.0/bios/bios.bin-1.13.0
vgaromimage: file=$work/deb/usr/share/vgabios/vgabios.bin
pci: enabled=1, chipset=i440fx
ata0-master: type=cdrom, path=$work/emu.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$work/serial.txt
display_library: nogui
log: $work/bochs.log
clock: sync=none
RC
rm -f serial.txt
"$bochs" -q -f bochsrc >bochs.out 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null && ! grep -q '^=== end' serial.txt 2>/dev/null; do sleep 5; done
sleep 2
kill "$pid" 2>/dev/null || true
sed -n '/^=== cpu/,/^=== end/p' serial.txt | grep -v '^\['
grep -q '^=== tests exit 0' serial.txt
