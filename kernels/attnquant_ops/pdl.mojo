# Programmatic dependent launch (sm_90+): a kernel launched with
# programmatic stream serialization may start while the kernel before it on
# the stream is still running, once every block of that kernel has called
# pdl_launch_dependents (or exited). Its blocks then fill the SMs the earlier
# kernel's last wave leaves idle and can fetch constants (weights) early; they
# must call pdl_wait before reading anything the earlier kernel writes and
# before writing anything at all (its inputs may share our outputs' memory).
#
# What the earlier kernel writes must be loaded with invariant=False. By default
# Mojo marks a load through an immutable pointer invariant on the GPU
# (ld.global.nc, the read-only path), and ptxas may move an invariant load
# above griddepcontrol.wait (it does so in the residual norm kernel), where it
# reads the earlier kernel's output before that is written. Constants
# (weights, gammas, scales) keep the read-only path. produced_invariant[PDL]()
# is the flag for the other loads.
#
# Both calls are no-ops for a kernel launched without the attribute, so a
# kernel compiled with them is correct however it is launched; the gain
# needs both neighbours to take part: the earlier one triggering early, the
# later one launched with pdl_attributes[True]().

from std.sys._assembly import inlined_assembly

from max.gpu.host.launch_attribute import LaunchAttribute, LaunchAttributeID, LaunchAttributeValue


@always_inline
def pdl_launch_dependents():
    """Lets the next kernel on the stream start (if it was launched with
    programmatic stream serialization) once every block has called this."""
    inlined_assembly["griddepcontrol.launch_dependents;", NoneType, constraints="~{memory}", has_side_effect=True]()


@always_inline
def pdl_wait():
    """Waits until the previous kernel on the stream has completed and its
    memory is visible (returns at once without programmatic launch)."""
    inlined_assembly["griddepcontrol.wait;", NoneType, constraints="~{memory}", has_side_effect=True]()


def pdl_attributes[PDL: Bool]() -> List[LaunchAttribute]:
    """The launch attributes of a kernel that takes part (PDL) or not."""
    var attrs = List[LaunchAttribute]()
    comptime if PDL:
        attrs.append(
            LaunchAttribute(LaunchAttributeID.PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttributeValue(True))
        )
    return attrs^


@always_inline
def produced_invariant[PDL: Bool]() -> Bool:
    """The `invariant` flag of a load of data the previous kernel writes:
    False under PDL (a plain, coherent ld.global that stays after pdl_wait),
    True otherwise (the read-only path, as Mojo's default)."""
    return not PDL
