"""scripts/build/check_sass.py on the SASS that hid the register-state kernel's dv2 store
(ptxas 13.0, kda_dhu_sm90_rs_k64_bf16 before its fix): it must flag the dead move of the
batch coordinate, and pass the same lines once the move runs (CPU only)."""

from __future__ import annotations

import importlib.util
import os

from helpers import REPO_ROOT

ROOT = REPO_ROOT

# The dh store's uniformizing loop sets P0 to true (0x7780); the dv2 store's batch row
# then moves into UR12 under @!P0 (0x77e0): never.
SASS = """
                                                                                                      /* 0x000fe200000e0000 */
        /*7720*/                   VIADD R12, R7, 0x14000 ;                                           /* 0x00014000070c7836 */
                                                                                                      /* 0x000fdc0000000000 */
        /*7730*/                   PLOP3.LUT P0, PT, P0, P1, PT, 0xa2, 0x0 ;                          /* 0x000000000000781c */
                                                                                                      /* 0x000fe40000703472 */
        /*7740*/               @P1 R2UR P0, UR25, R139 ;                                              /* 0x000000008b1912ca */
                                                                                                      /* 0x000fd00000000000 */
        /*7750*/                   PLOP3.LUT P0, PT, P0, P1, PT, 0xa2, 0x0 ;                          /* 0x000000000000781c */
                                                                                                      /* 0x000fe40000703472 */
        /*7760*/               @P1 R2UR.OR P0, UR24, R12 ;                                            /* 0x000000000c1812ca */
                                                                                                      /* 0x000fd00000100000 */
        /*7770*/               @P1 PLOP3.LUT P1, PT, P0, PT, PT, 0x80, 0x0 ;                          /* 0x000000000000181c */
                                                                                                      /* 0x000fe4000072f070 */
        /*7780*/                   PLOP3.LUT P0, PT, PT, PT, PT, 0x80, 0x0 ;                          /* 0x000000000000781c */
                                                                                                      /* 0x000fc60003f0f070 */
        /*7790*/                   UTMASTG.4D [UR24], [UR6] ;                                         /* 0x00000018060073b5 */
                                                                                                      /* 0x0005f00008018000 */
        /*77a0*/               @P1 BRA.U.ANY 0x7730 ;                                                 /* 0xfffffffd00e01947 */
                                                                                                      /* 0x004fea000393ffff */
        /*77b0*/              @!P3 IMAD R13, R13, 0x40, R4 ;                                          /* 0x000000400d0db824 */
                                                                                                      /* 0x000fe200078e0204 */
        /*77c0*/                   PLOP3.LUT P1, PT, PT, PT, UP0, 0x80, 0x0 ;                         /* 0x000000000000781c */
                                                                                                      /* 0x000fe20003f2f008 */
        /*77d0*/                   @!UP0 UIADD3 UR6, UP1, UR16, 0x2f0, URZ ;                          /* 0x000002f010068890 */
                                                                                                      /* 0x000fe2000ff3e03f */
        /*77e0*/              @!P0 R2UR UR12, R11 ;                                                   /* 0x000000000b0c82ca */
                                                                                                      /* 0x000fe200000e0000 */
        /*77f0*/              @!P3 VIADD R142, R7, 0x16000 ;                                          /* 0x00016000078eb836 */
                                                                                                      /* 0x000fe20000000000 */
        /*7800*/              @!P3 R2UR UR11, R13 ;                                                   /* 0x000000000d0bb2ca */
"""


def _check_sass():
    spec = importlib.util.spec_from_file_location(
        "check_sass", os.path.join(ROOT, "scripts", "build", "check_sass.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _insns(text: str):
    mod = _check_sass()
    return mod, [
        (int(m.group(1), 16), m.group(2).strip())
        for line in text.splitlines()
        for m in [mod.INSN.search(line)]
        if m
    ]


def test_the_dead_move_is_flagged():
    mod, insns = _insns(SASS)
    found = mod.dead_moves(insns)
    assert len(found) == 1 and "R2UR UR12, R11" in found[0] and "0x7780" in found[0], found


def test_a_move_that_runs_is_not_flagged():
    mod, insns = _insns(SASS.replace("@!P0 R2UR UR12, R11", "R2UR UR12, R11"))
    assert mod.dead_moves(insns) == []


def test_a_branch_target_between_clears_the_constant():
    # control arriving at the move from elsewhere: P0 may be anything there
    mod, insns = _insns(SASS)
    insns = insns + [(0x9000, "BRA 0x77e0")]
    assert mod.dead_moves(insns) == []
