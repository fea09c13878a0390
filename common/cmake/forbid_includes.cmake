# Fails (exit 1) when one of FILES has an #include matching PATTERN, saying
# WHY. Run at build time by the step shardcast_forbid_includes() (top
# CMakeLists.txt) adds, so a layer boundary is a fact of the build.
separate_arguments(_files UNIX_COMMAND "${FILES}")
set(_bad "")
foreach(f ${_files})
  file(STRINGS "${f}" _hits REGEX "^#include [<\"]${PATTERN}")
  foreach(h ${_hits})
    list(APPEND _bad "${f}: ${h}")
  endforeach()
endforeach()
if(_bad)
  list(JOIN _bad "\n  " _text)
  message(FATAL_ERROR "${WHY}:\n  ${_text}")
endif()
