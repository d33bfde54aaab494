#!/bin/sh
# Compiler wrapper for the build stage. DeepSpeed's op builder compiles with -march=native and the
# SIMD width of the build machine; an image must run on other CPUs, so both are replaced by the
# portable target $MEMASCEND_MARCH (default x86-64-v3: AVX2, every x86 GPU server since 2015).
real="/usr/bin/$(basename "$0")"
march=${MEMASCEND_MARCH:-x86-64-v3}
for arg in "$@"; do
  case $arg in
    -march=native) arg="-march=$march" ;;
    -mtune=native) arg="-mtune=generic" ;;
    -D__AVX512__) arg="-D__AVX256__" ;;
  esac
  set -- "$@" "$arg"
  shift
done
exec "$real" "$@"
