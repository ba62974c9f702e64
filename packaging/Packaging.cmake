# Installation of the programs, systemd units, default profile, man pages and package docs, and
# the deb and rpm packages (CPack). Included by the top-level CMakeLists.txt after every target is
# defined. packaging/build-packages.sh builds both packages from a fresh build directory and
# checks them; the traps it guards against are in packaging/README.md.
#
# Paths: everything is installed relative to the prefix (the packages use /usr) except the
# profile, which goes to the absolute /etc/writescope: the unit and the daemon's documentation
# name that path, and /usr/etc is no place for configuration. CPack's RPM generator marks every
# absolute path %config, so the units go to the relative lib/systemd/system (not LIBDIR, which is
# lib/x86_64-linux-gnu on Debian).

# The maintainer, in the deb's Maintainer field and the changelog's signature line.
set(WRITESCOPE_PACKAGE_CONTACT "writescope maintainers <maintainers@writescope.org>"
    CACHE STRING "Maintainer of the deb and rpm packages, as \"Name <email>\"")
# The packaging revision, one for both packages: the deb's version is 0.1.0-1, the rpm's
# Release 1. Raise it for a new package of the same upstream version.
set(WRITESCOPE_PACKAGE_RELEASE 1 CACHE STRING "Debian revision and rpm Release of the packages")
set(WRITESCOPE_PACKAGE_LICENSE "LicenseRef-none-chosen"
    CACHE STRING "License field of the rpm (no license has been chosen yet; see packaging/copyright)")

set(_ws_pkg_dir ${CMAKE_CURRENT_LIST_DIR})
set(_ws_src_dir ${PROJECT_SOURCE_DIR})
set(_ws_gen_dir ${PROJECT_BINARY_DIR}/packaging)
set(_ws_profile ${_ws_src_dir}/etc/writescope.toml)
file(MAKE_DIRECTORY ${_ws_gen_dir} ${PROJECT_BINARY_DIR}/man)

# One date for the man pages and the changelog, so two builds of one commit are byte-identical:
# SOURCE_DATE_EPOCH when set (the reproducible-builds convention), else the last commit's date.
if(DEFINED ENV{SOURCE_DATE_EPOCH})
  set(_ws_epoch $ENV{SOURCE_DATE_EPOCH})
else()
  execute_process(COMMAND git -C ${_ws_src_dir} log -1 --format=%ct
                  OUTPUT_VARIABLE _ws_epoch OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _ws_git_rc ERROR_QUIET)
  if(NOT _ws_git_rc EQUAL 0 OR _ws_epoch STREQUAL "")
    string(TIMESTAMP _ws_epoch "%s" UTC)
  endif()
endif()

# The programs' install() rules stand next to their targets in daemon/CMakeLists.txt
# (writescoped to sbin, writescopectl to bin); build-packages.sh fails when either is missing.

# --- systemd units, service user, directories ----------------------------------------------------
install(FILES ${_ws_src_dir}/systemd/writescoped.service ${_ws_src_dir}/systemd/writescoped.socket
        DESTINATION lib/systemd/system)
install(FILES ${_ws_src_dir}/systemd/writescope.sysusers DESTINATION lib/sysusers.d
        RENAME writescope.conf)
install(FILES ${_ws_src_dir}/systemd/writescope.tmpfiles DESTINATION lib/tmpfiles.d
        RENAME writescope.conf)

# --- The default profile (a conffile) -------------------------------------------------------------
if(EXISTS ${_ws_profile})
  install(FILES ${_ws_profile} DESTINATION /etc/writescope PERMISSIONS OWNER_READ OWNER_WRITE
          GROUP_READ WORLD_READ)
else()
  message(WARNING "etc/writescope.toml does not exist yet: the packages ship no profile")
endif()

# --- Man pages (scdoc sources in man/, gzipped roff installed) -------------------------------------
find_program(WRITESCOPE_SCDOC scdoc)
set(_ws_man_pages writescoped.8 writescope.toml.5 writescopectl.1 writescope-generate.1
                   writescope-tokenize.1)
set(_ws_man_roff "")
if(WRITESCOPE_SCDOC)
  set(_ws_man_gz "")
  foreach(page IN LISTS _ws_man_pages)
    string(REGEX MATCH "[0-9]$" section ${page})
    set(src ${_ws_src_dir}/man/${page}.scd)
    set(roff ${PROJECT_BINARY_DIR}/man/${page})
    # scdoc reads stdin only; gzip -n leaves the timestamp out (reproducible), -9 is what
    # lintian expects of man pages.
    add_custom_command(
      OUTPUT ${roff} ${roff}.gz
      COMMAND ${CMAKE_COMMAND} -E env SOURCE_DATE_EPOCH=${_ws_epoch}
              sh -c "\"$0\" <\"$1\" >\"$2\" && gzip -9nc \"$2\" >\"$2.gz\""
              ${WRITESCOPE_SCDOC} ${src} ${roff}
      DEPENDS ${src}
      COMMENT "scdoc: man/${page}"
      VERBATIM)
    list(APPEND _ws_man_roff ${roff})
    list(APPEND _ws_man_gz ${roff}.gz)
    install(FILES ${roff}.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man${section})
  endforeach()
  add_custom_target(writescope_man ALL DEPENDS ${_ws_man_gz})
else()
  message(STATUS "scdoc not found: the man pages are neither built nor installed")
endif()

# --- Package docs: copyright and changelog (Debian policy wants both) ----------------------------
# string(TIMESTAMP) takes its time from SOURCE_DATE_EPOCH in the environment.
set(_ws_had_epoch_env "$ENV{SOURCE_DATE_EPOCH}")
set(ENV{SOURCE_DATE_EPOCH} ${_ws_epoch})
string(TIMESTAMP WRITESCOPE_CHANGELOG_DATE "%a, %d %b %Y %H:%M:%S +0000" UTC)
if(_ws_had_epoch_env STREQUAL "")
  unset(ENV{SOURCE_DATE_EPOCH})
endif()
configure_file(${_ws_pkg_dir}/changelog.in ${_ws_gen_dir}/changelog @ONLY)
add_custom_command(
  OUTPUT ${_ws_gen_dir}/changelog.gz
  COMMAND sh -c "gzip -9nc \"$0\" >\"$0.gz\"" ${_ws_gen_dir}/changelog
  DEPENDS ${_ws_gen_dir}/changelog
  VERBATIM)
add_custom_target(writescope_package_docs ALL DEPENDS ${_ws_gen_dir}/changelog.gz)
install(FILES ${_ws_pkg_dir}/copyright ${_ws_gen_dir}/changelog.gz
        DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/writescope)

# --- Fast checks in the default test run ---------------------------------------------------------
if(BUILD_TESTING)
  find_program(WRITESCOPE_MANDOC mandoc)
  if(WRITESCOPE_SCDOC AND WRITESCOPE_MANDOC)
    add_test(NAME packaging.man-lint COMMAND ${WRITESCOPE_MANDOC} -T lint -W error ${_ws_man_roff})
    set_tests_properties(packaging.man-lint PROPERTIES LABELS unit)
  else()
    message(STATUS "scdoc or mandoc not found: no man page lint test")
  endif()
  find_program(WRITESCOPE_SYSTEMD_ANALYZE systemd-analyze)
  if(TARGET writescoped AND WRITESCOPE_SYSTEMD_ANALYZE)
    add_test(NAME packaging.units-verify
             COMMAND ${_ws_src_dir}/systemd/verify-units.sh $<TARGET_FILE:writescoped>)
    set_tests_properties(packaging.units-verify PROPERTIES LABELS unit)
  endif()
  if(TARGET writescoped AND TARGET writescopectl AND EXISTS ${_ws_profile})
    add_test(NAME packaging.man-coverage
             COMMAND ${_ws_src_dir}/tests/packaging/check-man-coverage.sh ${_ws_src_dir}
                     $<TARGET_FILE:writescoped> $<TARGET_FILE:writescopectl>)
    set_tests_properties(packaging.man-coverage PROPERTIES LABELS unit)
  endif()
  find_program(WRITESCOPE_GIT git)
  if(WRITESCOPE_GIT AND EXISTS ${_ws_src_dir}/.git)
    add_test(NAME docs.references
             COMMAND ${_ws_src_dir}/tests/packaging/check-doc-references.sh ${_ws_src_dir})
    set_tests_properties(docs.references PROPERTIES LABELS unit)
  endif()
endif()

# --- CPack: deb and rpm ---------------------------------------------------------------------------
set(CPACK_PACKAGE_NAME writescope)
set(CPACK_PACKAGE_VENDOR "the writescope authors")
set(CPACK_PACKAGE_CONTACT ${WRITESCOPE_PACKAGE_CONTACT})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "long-context MoE inference daemon with a CPU-GPU split KV cache")
set(_ws_description
    "writescoped serves long-context Mixture-of-Experts language models on one GPU.\n"
    "When the KV cache outgrows GPU memory it spills to host memory in a format\n"
    "whose residency is fixed at write time, and each decode step splits the\n"
    "spilled attention between CPU threads and the GPU by a roofline policy that\n"
    "is calibrated at boot and tracked online. The API is HTTP over a Unix socket,\n"
    "and writescopectl is its command-line client. Without a GPU it runs on the CPU.")
string(CONCAT CPACK_PACKAGE_DESCRIPTION ${_ws_description})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# The unit names /usr/sbin/writescoped and the profile lives in /etc: nothing is relocatable.
set(CPACK_PACKAGE_RELOCATABLE OFF)
set(CPACK_STRIP_FILES ON)
set(CPACK_PACKAGE_CHECKSUM SHA256)
set(CPACK_OUTPUT_FILE_PREFIX ${PROJECT_BINARY_DIR}/packages)

find_program(WRITESCOPE_RPMBUILD rpmbuild)
set(CPACK_GENERATOR DEB)
if(WRITESCOPE_RPMBUILD)
  list(APPEND CPACK_GENERATOR RPM)
else()
  message(STATUS "rpmbuild not found: cpack builds the deb only")
endif()

# deb. CPack writes no conffiles of its own: packaging/deb/conffiles lists the profile.
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE ${WRITESCOPE_PACKAGE_RELEASE})
# CPack puts the summary on the Description line itself; this is the extended part.
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION ${CPACK_PACKAGE_DESCRIPTION})
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Library dependencies come from dpkg-shlibdeps. adduser is named by hand: postinst falls back to
# it where systemd-sysusers is missing (lintian asks for the dependency either way).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# libpcre2-8-0 and libicu72 (the tokenizers' regexes and normalisation) are named too, so the
# dependency stays declared if a build links them statically.
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser, libpcre2-8-0, libicu72")
set(_ws_deb_control ${_ws_pkg_dir}/deb/postinst ${_ws_pkg_dir}/deb/prerm ${_ws_pkg_dir}/deb/postrm)
if(EXISTS ${_ws_profile})
  list(APPEND _ws_deb_control ${_ws_pkg_dir}/deb/conffiles)
endif()
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA ${_ws_deb_control})
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)

# rpm. Requires come from rpmbuild's own scan of the binaries.
set(CPACK_RPM_FILE_NAME RPM-DEFAULT)
set(CPACK_RPM_PACKAGE_RELEASE ${WRITESCOPE_PACKAGE_RELEASE})
set(CPACK_RPM_PACKAGE_LICENSE ${WRITESCOPE_PACKAGE_LICENSE})
set(CPACK_RPM_PACKAGE_DESCRIPTION ${CPACK_PACKAGE_DESCRIPTION})
set(CPACK_RPM_POST_INSTALL_SCRIPT_FILE ${_ws_pkg_dir}/rpm/post.sh)
set(CPACK_RPM_PRE_UNINSTALL_SCRIPT_FILE ${_ws_pkg_dir}/rpm/preun.sh)
set(CPACK_RPM_POST_UNINSTALL_SCRIPT_FILE ${_ws_pkg_dir}/rpm/postun.sh)
if(EXISTS ${_ws_profile})
  # Overrides the plain %config CPack gives absolute paths: an edited profile survives upgrades.
  set(CPACK_RPM_USER_FILELIST "%config(noreplace) /etc/writescope/writescope.toml")
endif()
# Directories other packages own (filesystem, systemd, man-db): listing them here as ours would
# make rpm report conflicts on install.
set(CPACK_RPM_EXCLUDE_FROM_AUTO_FILELIST_ADDITION
    /usr/sbin /usr/lib/systemd /usr/lib/systemd/system /usr/lib/sysusers.d /usr/lib/tmpfiles.d
    /usr/share/man /usr/share/man/man1 /usr/share/man/man5 /usr/share/man/man8)

# The CUDA backend links cudart statically (cuda/CMakeLists.txt), which loads the driver's
# libcuda.so.1 at run time: no ELF dependency shows it, and without it the daemon falls back to
# the CPU, so the driver is recommended, not required.
if(WRITESCOPE_HAVE_CUDA)
  set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libcuda1")
  # By soname, so any driver package satisfies it. CMake 3.25 drops CPACK_RPM_PACKAGE_SUGGESTS
  # (its probe for weak dependencies fails with Debian's rpm 4.18), hence the line is written
  # straight into the spec's preamble.
  set(CPACK_RPM_SPEC_MORE_DEFINE "Recommends: libcuda.so.1()(64bit)")
endif()

include(CPack)
