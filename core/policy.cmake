# writescope_policy: the WriteScope policy (docs/design.md sections 4 and 6): the roofline, the
# execution modes, the robust online cost trackers, the per-step plan and the warm-start state.
add_library(writescope_policy STATIC
  src/policy/roofline_policy.cpp
  src/policy/line_fit.cpp
  src/policy/execution_mode.cpp
  src/policy/cost_tracker.cpp
  src/policy/policy_trackers.cpp
  src/policy/step_plan.cpp
  src/policy/policy_state.cpp
)
target_link_libraries(writescope_policy PUBLIC writescope_core_base)
set_target_properties(writescope_policy PROPERTIES POSITION_INDEPENDENT_CODE ON)
