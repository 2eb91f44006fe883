# ctest driver: configures, builds and runs the consumer project in one mode.
#   cmake -DMODE=find_package|add_subdirectory -DSOURCE_DIR=... -DWORK_DIR=... -P run_consumer.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
set(prefix_arg "")
if(MODE STREQUAL "find_package")
  # Install the library from its source tree into a private prefix, as a user's package manager would.
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/lib -DCONTRASTIVE_BUILD_TESTS=OFF
      -DCONTRASTIVE_BUILD_BENCHMARKS=OFF -DCONTRASTIVE_BUILD_EXAMPLES=OFF -DCONTRASTIVE_ENABLE_CUDA=OFF
      -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/lib)
  set(prefix_arg -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
endif()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -DCONSUMER_MODE=${MODE}
    -DCONTRASTIVE_SOURCE_DIR=${SOURCE_DIR} -DCMAKE_CXX_STANDARD=${CXX_STANDARD} ${prefix_arg})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
