# A CMake toolchain for manylinux wheels (make wheel): zig's clang, from the
# ziglang package on PyPI, compiling against the symbol versions of glibc 2.17
# (manylinux2014, the oldest glibc JAX's own wheels ask for is newer) and
# linking LLVM's libc++ in statically, so the extension needs no C++ runtime
# of the user's machine. ZIG names the zig executable.
if(NOT DEFINED ENV{ZIG})
  message(FATAL_ERROR "zig-manylinux.cmake: set ZIG to the zig executable "
                      "(make wheel takes it from the ziglang package)")
endif()
set(_target "${CMAKE_HOST_SYSTEM_PROCESSOR}-linux-gnu.2.17")
set(CMAKE_C_COMPILER "$ENV{ZIG}" cc -target ${_target})
set(CMAKE_CXX_COMPILER "$ENV{ZIG}" c++ -target ${_target})
# zig's cc and c++ add DWARF debug info by default, which CMake's Release build
# does not ask for and the wheel's link drops: -g0 leaves the machine code as it
# is and spends a third less time on the slowest file (the AVX-512 CPU kernel).
#
# zig builds its libc++ (and libc stubs, compiler-rt) into its cache at the
# first link of each variant: optimized or not, stripped or not. The
# extension's link is optimized and stripped (nanobind strips a Release
# module), so every program configure links (the compiler identification
# too, which takes these flags and no linker flags) is as well: -O2, and -s,
# zig's strip, which compiles ignore. A cold cache then builds one libc++,
# not two (wheel build on a 2-core machine: 194 s -> 117 s), and the
# extension is byte for byte the same (Release compiles at -O3).
set(CMAKE_C_FLAGS_INIT "-g0 -O2 -s")
set(CMAKE_CXX_FLAGS_INIT "-g0 -O2 -s")
