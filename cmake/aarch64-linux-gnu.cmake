# Cross build for aarch64 on a Debian x86-64 host: Debian's cross compiler
# (g++-aarch64-linux-gnu) and the arm64 multiarch packages (libabsl-dev:arm64,
# libgtest-dev:arm64), whose CMake configs CMAKE_LIBRARY_ARCHITECTURE finds under
# /usr/lib/aarch64-linux-gnu/cmake. Binaries run under qemu-user, which CMake uses to list the
# gtest cases and to run the tests. There are no arm64 builds of OpenCL, Open MPI or gRPC
# here, hence -DEPSERVE_PORTABLE_ONLY=ON:
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#     -DEPSERVE_PORTABLE_ONLY=ON
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Programs run against the arm64 runtime that libabsl20220623:arm64 pulls in (libc6:arm64,
# libstdc++6:arm64: /lib/ld-linux-aarch64.so.1, /usr/lib/aarch64-linux-gnu), as on an arm64
# Debian machine; `-L /` keeps their paths untranslated.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /)
