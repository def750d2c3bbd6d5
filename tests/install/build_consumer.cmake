# cmake -DCMAKE_COMMAND_TO_USE=<cmake> -DSOURCE_DIR=... -DBUILD_DIR=... -DPREFIX=<install prefix>
#       -DGENERATOR=<generator> -DCXX_COMPILER=<c++> -P build_consumer.cmake
# Configures and builds the consumer from scratch against the installed prefix only.
foreach(var CMAKE_COMMAND_TO_USE SOURCE_DIR BUILD_DIR PREFIX GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "build_consumer.cmake: ${var} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${BUILD_DIR}")
execute_process(
  COMMAND "${CMAKE_COMMAND_TO_USE}" -S "${SOURCE_DIR}" -B "${BUILD_DIR}" -G "${GENERATOR}"
          -DCMAKE_BUILD_TYPE=Release
          -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
          -DCMAKE_PREFIX_PATH=${PREFIX}
          -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer against ${PREFIX} failed (${rc})")
endif()
execute_process(COMMAND "${CMAKE_COMMAND_TO_USE}" --build "${BUILD_DIR}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer failed (${rc})")
endif()
