# Fails when a kernel source uses what OpenCL C 1.2 forbids and some drivers reject although
# PoCL accepts it: variadic macros (NVIDIA's compiler: "variadic macros not supported in
# OpenCL"). The kernel tests here run on PoCL only, so this is the check that keeps GPU builds
# from breaking unseen.
#   cmake -DSOURCE_DIR=<kernels/cl> -P check_cl_sources.cmake
file(GLOB sources "${SOURCE_DIR}/*.cl")
if(NOT sources)
  message(FATAL_ERROR "no .cl files in ${SOURCE_DIR}")
endif()
set(bad "")
foreach(source ${sources})
  file(STRINGS "${source}" lines REGEX "(#[ \t]*define[ \t]+[A-Za-z_0-9]+\\([^)]*\\.\\.\\.)|__VA_ARGS__")
  foreach(line ${lines})
    get_filename_component(name "${source}" NAME)
    string(APPEND bad "\n  ${name}: ${line}")
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "variadic macros (not OpenCL C 1.2; NVIDIA's compiler rejects them):${bad}")
endif()
list(LENGTH sources count)
message(STATUS "${count} kernel sources checked: no variadic macros")
