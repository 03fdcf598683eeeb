# Per-component include roots, the way prometheus-cpp gives each component its own include/
# folder: a target's public include directory is a folder of the build tree that holds only a
# link named after the target's source folder, so that `#include "kernels/runtime.h"` resolves
# only in a target that links epserve::kernels (directly, or through a PUBLIC dependency). An
# include across the layers of docs/ARCHITECTURE.md is then a compile error; what the build
# cannot see (a folder's detail/ headers, two targets of one folder) is
# tests/portability/layering_test.sh's.
#
#   epserve_include_root(TARGET FOLDER [HEADER...])
# Gives TARGET the root ${PROJECT_BINARY_DIR}/include/TARGET holding FOLDER, a link to
# ${PROJECT_SOURCE_DIR}/FOLDER, or, with HEADERs, a folder FOLDER of links to those headers
# alone (a header-only part of a folder, for targets that may not link the rest).
function(epserve_include_root target folder)
  set(root ${PROJECT_BINARY_DIR}/include/${target})
  if(ARGN)
    file(MAKE_DIRECTORY ${root}/${folder})
    foreach(header ${ARGN})
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder}/${header} ${root}/${folder}/${header}
           SYMBOLIC)
    endforeach()
  else()
    file(MAKE_DIRECTORY ${root})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${root}/${folder} SYMBOLIC)
  endif()
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "INTERFACE_LIBRARY")
    target_include_directories(${target} INTERFACE ${root})
  elseif(type STREQUAL "EXECUTABLE")
    target_include_directories(${target} PRIVATE ${root})
  else()
    target_include_directories(${target} PUBLIC ${root})
  endif()
endfunction()

# The same root for the source files of a directory and its subdirectories (tests/, bench/:
# their own helpers, `#include "tests/e2e/server_process.h"`); every other folder's headers
# they reach through the targets they link.
function(epserve_directory_include_root folder)
  set(root ${PROJECT_BINARY_DIR}/include/_${folder})
  file(MAKE_DIRECTORY ${root})
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${root}/${folder} SYMBOLIC)
  include_directories(${root})
endfunction()
