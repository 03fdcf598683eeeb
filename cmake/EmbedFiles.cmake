# epserve_embed_files(<out_cc> <symbol_prefix> <files>...)
# At build time, writes <out_cc> defining, for each file, a
#   extern const std::string_view <symbol_prefix><stem>;
# holding the file's bytes. The generated file is rewritten whenever a source changes.
set(EPSERVE_EMBED_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/EmbedFilesScript.cmake)
function(epserve_embed_files out_cc prefix)
  set(files ${ARGN})
  add_custom_command(
    OUTPUT ${out_cc}
    COMMAND ${CMAKE_COMMAND} -DOUT=${out_cc} -DPREFIX=${prefix} "-DFILES=${files}"
            -P ${EPSERVE_EMBED_SCRIPT}
    DEPENDS ${files} ${EPSERVE_EMBED_SCRIPT}
    COMMENT "Embedding ${prefix} sources"
    VERBATIM)
endfunction()
