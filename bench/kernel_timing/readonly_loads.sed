# The PDL kernels as they were before their activation loads left the
# read-only path: every coherent 16-byte load (ld.global.v4.b32: in gd0, zd0
# and rd0 exactly the loads of what the previous kernel wrote) goes back to
# ld.global.nc, which ptxas may move above griddepcontrol.wait.
# build_ptx.sh makes the control kernels gdx, zdx and rdx with it.
s/ld\.global\.v4\.b32/ld.global.nc.v4.b32/g
