/*
 * ring.pml -- a Promela model of the one-sided ring buffer (DESIGN §5, issue 3), checked with
 * spin by tests/test_ring_model.py.  It models the protocol of writer.py (sender steps 1-8)
 * and reader.py (receiver steps 1-5) -- and of their compiled twins ring_send / ring_recv in
 * _atomics_build.py, which do the same steps -- as they stand; every model step carries the
 * number of the code step it is ("writer.py step 6"); layout.py gives the words, entry.py the
 * checksum.  -DOLD_* flags give back the first version of the code (commit bf44540), in
 * which this model found the two bugs described under FINDINGS.
 *
 * SYSTEM: three senders (lock tokens 1..3) and one receiver.  Sizes are small so that the
 * search is exhaustive and quick; each can be overridden with -D on the spin command line:
 *   NS    size slots (a power of two, as layout.Geometry demands)             default 2
 *   NB    buffer cells (a cell stands for a run of the code's 8-byte words)   default 4
 *   NE    messages each sender sends                                          default 1
 *   MAXF  fault budget of a run (see FAULTS)                                  default 2
 *   SMOD  modulus of the entry counters (the code's 2**24)                    default 8
 *   BMOD  modulus of the buffer counters (the code's 2**40)                   default 16
 * A message is 1 or 2 cells long, chosen nondeterministically: cell 0 is the entry header
 * (entry.py: magic, seq, length, checksum), cell 1 its payload.  NB = 4 with lengths 1..2
 * gives wrap-around at the buffer's end, buffer-full and slot-full; NS = 2 with 3 messages
 * gives slot reuse on the next lap.  With NE = 1 no counter wraps within a run (a stall
 * across 2**24 entries); -DNE=2 -DSMOD=4 -DBMOD=8 makes them wrap.
 *
 * REGION WORDS (layout.py): globals, each read, stored or CASed atomically:
 *   lock      TAINT (layout.LOCK_TAINT) if a lock was ever taken over, plus the holder's token
 *             (0: free); CAS only
 *   tails     PACK(buffer counter, entry counter); moved by CAS only, both at once
 *   heads     the same packing; stored by the receiver only
 *   slots[]   busy bit | lap | length  (SLOT_BUSY / SLOT_FREE below)
 *   cells[]   the buffer region
 *
 * ABSTRACTIONS (and why each is sound for the properties checked):
 * - Checksum: a cell holds (writer, message id, cell index), a header cell also the entry
 *   counter and length it was written for; GARBAGE (0) is a cell never written.  The
 *   receiver accepts an entry iff the header names the slot's entry counter and length and
 *   every cell holds what that writer wrote for that message: an ideal checksum (no
 *   collisions) over header and payload, as entry.parse checks them.  Payload cells carry no
 *   entry counter, as in the code, so an older copy of the same payload still passes, just
 *   as it would pass the real checksum.
 * - Cells are written (step 5) and copied (reader step 2) one at a time, and a sender may
 *   stall between any two.  The receiver copies the header first; a sender writes it first
 *   (writer.py) or last (ring_send), chosen nondeterministically.  A torn cell (read while
 *   being written) is not modelled as a value of its own: it could only make the receiver
 *   drop an entry, and a drop and a delivery lead to the same steps 4-5; the model lets the
 *   read see the old or the new value instead, which delivers at least as often, so no
 *   duplicate is missed.
 * - Step 2 reads the lock word, the tails word and the heads word, one step each (word by
 *   word, in this order, in both implementations), so a sender can see heads that moved
 *   after its tails, or find the lock its own and then read tails moved by a new holder.
 * - MAX_ROUNDS (16) is not modelled: every extra round follows a repair, a failed publish or
 *   tails found stale at step 4, each needing a slot published in this run after our step 2,
 *   and a run publishes at most 3 * NE < 16 entries.
 * - Generation/state words and PeerGone are left out (one incarnation of the region), and so
 *   is the caller's deadline: a sender told "full" releases the lock and tries again.
 * - Lock tokens are the senders' indices.  The code's per-acquisition counter serves the
 *   waiter's timeout bookkeeping only; a sender can never meet a stale token of its own
 *   because it holds at most one acquisition at a time.
 * - Lock timeout: a waiter may take the lock over (CAS from the holder's token) only while
 *   the holder is stalled or crashed, i.e. it has seen that token "long enough".  A holder can
 *   stall before ANY step, so the take-over can fall between any two of its steps, which also
 *   covers a waiter that timed out just before the holder woke up.
 * - Memory is sequentially consistent, which the code's order (bytes, then the slot CAS, then
 *   the tails CAS) gets on x86 with locked CAS.
 *
 * FAULTS, possible before every step of a sender:
 *   stall  a lock holder stops; while it is stopped a waiter may take its lock over; it
 *          resumes later and carries on with its stale local copies, as the code would (step
 *          6 CAS fails on busy/lap, step 7 CAS from stale tails, step 8 CAS-release of its
 *          own token).  A sender that does not hold the lock "stalls" simply by not being
 *          scheduled, which interleaving already covers.
 *   crash  a sender stops for good, holding whatever it held (the lock included).
 *   Safety run (-DSAFETY_RUN): crashes are left out, since a crashed sender's run is a prefix
 *   of the run in which it stalls and never resumes; stalls are free and each take-over
 *   costs one of MAXF (a stall no one takes over is just a delay).  Liveness run: every
 *   stall and every crash costs one of MAXF, so no run stalls infinitely often.
 *
 * PROPERTIES.
 *   Safety (assertions; pan built with -DSAFETY -DNOCLAIM, which also reports invalid end
 *   states, i.e. deadlocks):
 *     S1 no corrupted delivery: an entry handed up names a real writer and message, with the
 *        length that writer chose, and every cell is what it wrote for that message;
 *     S2 no duplicated delivery: each (writer, message) is handed up at most once;
 *     S3 a busy size slot is never overwritten by a sender before the receiver clears it
 *        (asserted at the sender's publish and at the receiver's clear);
 *     S4 heads never pass tails: 0 <= tails - heads <= NS entries and <= NB cells, asserted
 *        at every store or CAS of either word;
 *     S5 no sender writes into an entry the receiver is holding (from its step 1 until its
 *        step 4: verifying it, and, borrowed, while the consumer reads it in place) if the
 *        lock word carried no TAINT at that step 1, asserted at every cell a sender writes.
 *        This is what lets ring_release (_atomics_build.py) skip hashing a borrowed entry
 *        again when no take-over has happened: only a sender whose lock was taken over can
 *        write over a published entry.
 *   Liveness (ltl "live"; -DLIVENESS_RUN, pan built without -DSAFETY, run with -a -f):
 *     <> (every sender has finished or crashed, and heads == tails)
 *     i.e. the ring never wedges: every write() of every sender that does not crash returns
 *     (published; or LostLock / Unconfirmed after a fault), so a sender that keeps
 *     publishing keeps getting through, and the receiver consumes every entry the tails
 *     have passed.  The liveness run erases the cells' contents and the delivery record
 *     (see LIVENESS_RUN below): no step's control flow depends on them.
 *   FAIRNESS: weak fairness per process (pan -f) is assumed, and needed: the receiver
 *   eventually polls a slot that stays ready; a waiter eventually takes over the lock of a
 *   crashed holder (the take-over stays enabled); a stalled sender eventually resumes (a stall
 *   is finite; stopping for good is a crash); a sender told "full" eventually tries again.
 *   Faults are bounded (MAXF).  Without fairness the receiver could simply never run.
 *
 * FINDINGS.  In the first version of the code (commit bf44540) the model found two bugs;
 * the code now carries the fixes, and -DOLD_* puts the old behaviour back:
 *   -DOLD_RECEIVER (reader.py step 1).  The receiver consumed a busy slot at the head even
 *     when the tails had not passed it: its sender did step 6 and was before step 7.  Heads
 *     then pass tails (S4 fails, even with no fault), and if that sender crashed there, every
 *     later sender reads seq_used(tails, heads) = 2**24 - 1 at step 3 and reports "full" for
 *     ever: the ring is wedged ("live" fails).  Now the receiver waits until the tails' entry
 *     counter has moved past the head (the next sender's step-4 repair moves it).
 *   -DOLD_RESEND (writer.py step 6).  When the publish CAS failed because a stale sender had
 *     published at this slot first, the sender wrote its entry again further on (go to 2).
 *     But the stale sender's slot may describe OUR bytes (we wrote after it, at the same
 *     buffer tail): with equal lengths the receiver hands our message up there and again at
 *     the next slot, a duplicate (S2 fails).  Now it goes to 2 only if the slot holds another
 *     length (our copy then fails the length check there), else raises Unconfirmed.
 *   -DOLD_STEP2, -DOLD_STEP4: the step-2 lock check and the step-4 "free for a later lap"
 *     re-read, both added with those fixes; neither is needed for S1-S4 or "live" here.
 *   LostLock raised at step 6 does not mean "not handed up": a stale sender that wrote over
 *     the new holder's entry (same buffer tail, same length) and then fails its CAS gets
 *     LostLock, yet the receiver hands ITS bytes up under the new holder's slot (writer.py's
 *     LostLock docstring says so).  -DCALLER_RESENDS (the caller sends the message again after
 *     that LostLock) breaks S2; -DCALLER_RESENDS_2 (again after a step-2 LostLock, "nothing
 *     written") does not.
 *   Counter wrap (theoretical, not fixed).  With -DNE=2 -DSMOD=4 (a one-bit lap) the model
 *     finds a duplicate: a sender whose lock was taken over is held up between its step 2
 *     and step 6 while the entry counter goes round exactly once; its step-6 CAS from
 *     "free, lap" then succeeds on the reused slot (with -DBMOD=8 too, its step-7 CAS also
 *     hits a tails word that came back to the same value, breaking S4).  The lap prevents
 *     this ABA only modulo 2**24 entries: in the code a stall across a multiple of 2**24
 *     entries (and, for the tails CAS, of 2**40 bytes as well) is needed.
 * Deliberately broken variants, which must fail (so that passing is not vacuous):
 *   -DBROKEN_SLOT        step 6 stores busy|lap|length over a slot of its lap whether busy or
 *                        not, instead of CAS from "free": S3 fails;
 *   -DBROKEN_NOCHECK     the receiver hands up whatever it copied: S1 fails;
 *   -DBROKEN_NOTAKEOVER  no lock take-over after the timeout: a crashed holder blocks
 *                        everyone, "live" fails;
 *   -DBROKEN_TAINT       a take-over does not set TAINT: the stale holder's late write lands
 *                        in an entry held as clean, S5 fails;
 *   -DOLD_RECEIVER -DNO_S4   the old receiver with S4 switched off: "live" fails (the wedge).
 */

#ifndef NS
#define NS 2
#endif
#ifndef NB
#define NB 4
#endif
#ifndef NE
#define NE 1
#endif
#ifndef MAXF
#define MAXF 2
#endif
#ifndef SMOD
#define SMOD 8
#endif
#ifndef BMOD
#define BMOD 16
#endif
#define NW 3            /* senders */

/* what a fault costs (see FAULTS above) */
#ifdef SAFETY_RUN
#define STALL_COST      skip
#define TAKEOVER_OK     (faults > 0)
#define TAKEOVER_COST   faults--
#else
#define STALL_COST      faults--
#define TAKEOVER_OK     true
#define TAKEOVER_COST   skip
#endif

/* layout.pack_ptrs / unpack_ptrs / seq_used / buf_used / lap_of */
#define PACK(b, s)      (((s) % SMOD) * BMOD + ((b) % BMOD))
#define PB(p)           ((p) % BMOD)
#define PS(p)           ((p) / BMOD)
#define SEQ_USED(t, h)  ((PS(t) - PS(h) + SMOD) % SMOD)
#define BUF_USED(t, h)  ((PB(t) - PB(h) + BMOD) % BMOD)
#define LAP(s)          (((s) % SMOD) / NS)

/* layout.slot_free / slot_busy / slot_fields: busy bit 128 | lap * 8 | length (< 8) */
#define SLOT_FREE(l)     ((l) * 8)
#define SLOT_BUSY(l, n)  (128 + (l) * 8 + (n))
#define IS_BUSY(w)       ((w) >= 128)
#define SLAP(w)          (((w) % 128) / 8)
#define SLEN(w)          ((w) % 8)

/* a cell: writer (1..3, 0 = garbage), entry id, cell index, and for a header cell the entry
   counter and length it was written for */
#define CELL(w, e, k, s, n)  (((((w) * 4 + (e)) * 2 + (k)) * 32 + (s)) * 8 + (n))
#define CN(c)   ((c) % 8)
#define CS(c)   (((c) / 8) % 32)
#define CK(c)   (((c) / 256) % 2)
#define CE(c)   (((c) / 512) % 4)
#define CW(c)   ((c) / 2048)
#define GARBAGE 0

/* the lock word: TAINT (sticky, set by a take-over) + the holder's token (1..NW; 0: free) */
#define TAINT        4
#define HOLDER(l)    ((l) % TAINT)
#ifdef BROKEN_TAINT
#define TAKEN(l, t)  ((l) - HOLDER(l) + (t))      /* BROKEN: the take-over leaves no mark */
#else
#define TAKEN(l, t)  (TAINT + (t))               /* writer.py step 1: LOCK_TAINT | token */
#endif

/* S4: heads never pass tails (-DNO_S4 leaves it out, to show the liveness check alone) */
#ifdef NO_S4
#define HT_OK   true
#else
#define HT_OK   (SEQ_USED(tails, heads) <= NS && BUF_USED(tails, heads) <= NB)
#endif

/* ---- the region --------------------------------------------------------------------------- */
byte  lock;             /* layout.W_LOCK */
short tails;            /* layout.W_TAILS */
short heads;            /* layout.W_HEADS */
byte  slots[NS];        /* size region: all "free, lap 0" at init (region.init) */
short cells[NB];        /* buffer region */

/* ---- fault bookkeeping and ghost state (not part of the region) --------------------------- */
byte  faults = MAXF;    /* faults left in this run */
bool  stalled[NW + 1];  /* stalled[t]: the sender with token t is stopped (stalled or crashed) */
byte  ndone;            /* senders finished or crashed */
byte  delivered[NW + 1];/* bit e of delivered[w]: (w, e) handed up */
byte  wrote[(NW + 1) * NE]; /* wrote[w * NE + e]: the length w chose for its message e */
byte  hold_lo, hold_n;  /* S5: the cells of the entry held as clean (hold_n = 0: none) */

/* The liveness run (-DLIVENESS_RUN) erases what no step's control flow depends on: the
   cells' contents and the record of deliveries (the receiver's verdict only decides what
   it hands up; its steps 4-5 are the same either way, and senders never read cells).  The
   steps themselves all stay. */
#ifdef LIVENESS_RUN
#define STORE_CELL(i, v)  skip
#define LOAD_CELL(i)      GARBAGE
#define DELIVERED(w, e)   skip
#define WROTE(w, e, n)    skip
#define HOLD(clean)       skip
#define UNHOLD            skip
#else
#define WROTE(w, e, n)    wrote[(w) * NE + (e)] = (n)
#define IN_HOLD(i)        (hold_n > 0 && ((i) - hold_lo + NB) % NB < hold_n)
#define STORE_CELL(i, v)  assert(!IN_HOLD(i)); cells[i] = v                       /* S5 */
#define HOLD(clean)       if :: clean -> hold_lo = PB(heads) % NB; hold_n = L :: else fi
#define UNHOLD            hold_lo = 0; hold_n = 0
#define LOAD_CELL(i)      cells[i]
#define DELIVERED(w, e)   delivered[w] = delivered[w] | (1 << (e))
#endif

/* What the caller does after LostLock: its next message.  -DCALLER_RESENDS makes it send the
   same message again after a LostLock raised at step 6 (an entry written), -DCALLER_RESENDS_2
   after one raised at step 2 (writer.py: "nothing written"). */
#ifdef CALLER_RESENDS
#define LOST_LOCK_6  pc = P_FULL
#else
#define LOST_LOCK_6  e++; pc = P_S8
#endif
#ifdef CALLER_RESENDS_2
#define LOST_LOCK_2  pc = P_FULL
#else
#define LOST_LOCK_2  e++; pc = P_S8
#endif

/* the receiver's ready test (reader.py step 1) */
#define LAP_OK(w, s)  (SLAP(w) == LAP(s))
#ifdef OLD_RECEIVER
#define PASSED(s)     true                  /* bf44540: no look at the tails */
#else
#define PASSED(s)     (PS(tails) != (s))     /* the tails' entry counter has moved past it */
#endif

ltl live { <> (ndone == NW && tails == heads) }

/* a new message: its length, 1 or 2 cells, nondeterministically */
#define NEW_MESSAGE  if :: pc == P_NEXT -> if :: n = 1 :: n = 2 fi; WROTE(me, e, n) :: else fi

/* sender program counter: which code step comes next */
#define P_NEXT   0    /* caller: next message, or finished */
#define P_S1     1    /* writer.py step 1 */
#define P_S2L    2    /* writer.py step 2: the lock word */
#define P_S2T    3    /* writer.py step 2: the tails word */
#define P_S2H    4    /* writer.py step 2: the heads word, then step 3 */
#define P_S4     5    /* writer.py step 4: read the slot at the tail */
#define P_S4R    6    /* writer.py step 4: repair, CAS on the tails */
#define P_S5     7    /* writer.py step 5: a cell */
#define P_S6     8    /* writer.py step 6: publish CAS */
#define P_S6L    9    /* writer.py step 6: CAS failed, read the lock word */
#define P_S7    10    /* writer.py step 7 */
#define P_S8    11    /* writer.py step 8, then the next message */
#define P_FULL  12    /* writer.py step 8 after "full", then step 1 again */

proctype sender(byte me)   /* me: the sender's index, which is also its lock token */
{
    byte pc = P_NEXT;
    byte e;             /* id of the message being sent (0..NE-1) */
    byte n;             /* its length in cells */
    short lt, lh;       /* step 2's copies of the tails and heads words */
    byte sw;            /* a slot word read */
    byte k;             /* cells written so far */
    bool hl;            /* step 5 writes the header last (the compiled path) */

    do
    /* ---- faults, before any step (see FAULTS above for where they are placed) ---- */
    :: atomic { faults > 0 && HOLDER(lock) == me -> STALL_COST; stalled[me] = true };   /* stall */
       if
#ifndef SAFETY_RUN
       :: atomic { ndone++; goto crashed }    /* ... for good: a crash holding the lock */
#endif
       :: stalled[me] = false                 /* resume, with stale local copies */
       fi
#ifndef SAFETY_RUN
    :: atomic { faults > 0 && HOLDER(lock) != me && pc != P_NEXT ->          /* crash */
           faults--; stalled[me] = true; ndone++; goto crashed }
#endif

    /* ---- the caller (RingWriter.write): all messages sent? ---- */
    :: atomic { pc == P_NEXT && e == NE -> ndone++; break }

    /* writer.py step 1: take the lock (CAS free -> free | token; free is 0 or TAINT) ...
       (for a new message, its length is chosen here too: a local choice, made in the same
       step only to keep the state space small) */
    :: atomic { (pc == P_S1 || pc == P_NEXT && e < NE) && HOLDER(lock) == 0 ->
           NEW_MESSAGE; lock = lock + me; pc = P_S2L }
    /* writer.py step 1: ... or take it over after the lock timeout (CAS holder's word ->
       TAINT | token) */
#ifndef BROKEN_NOTAKEOVER
    :: atomic { (pc == P_S1 || pc == P_NEXT && e < NE) && HOLDER(lock) != 0 &&
                stalled[HOLDER(lock)] && TAKEOVER_OK ->
           NEW_MESSAGE; TAKEOVER_COST; lock = TAKEN(lock, me); pc = P_S2L }
#endif

    /* writer.py step 2: read the header words, the lock word first; if it is no longer our
       token: LostLock, nothing written.  (The code reads the tails and heads words next and
       only then looks at the lock; those reads change nothing, so the model stops here.) */
    :: atomic { pc == P_S2L ->
           if
#ifdef OLD_STEP2
           :: true -> pc = P_S2T                  /* bf44540: no look at the lock */
#else
           :: HOLDER(lock) != me -> LOST_LOCK_2
           :: HOLDER(lock) == me -> pc = P_S2T
#endif
           fi }
    /* writer.py step 2: the tails word */
    :: atomic { pc == P_S2T -> lt = tails; pc = P_S2H }
    /* writer.py step 2: the heads word;  writer.py step 3: room for an entry counter */
    :: atomic { pc == P_S2H -> lh = heads;
           if
           :: SEQ_USED(lt, lh) >= NS -> pc = P_FULL
           :: else -> pc = P_S4
           fi }
    /* writer.py step 4: the slot at the tail: busy for an older lap: full; busy for this lap:
       repair; free for a later lap: our tails are stale, go to 2; else room for the bytes? */
    :: atomic { pc == P_S4 -> sw = slots[PS(lt) % NS];
           if
           :: IS_BUSY(sw) && SLAP(sw) != LAP(PS(lt)) -> pc = P_FULL   /* not cleared yet */
           :: IS_BUSY(sw) && SLAP(sw) == LAP(PS(lt)) -> pc = P_S4R
#ifdef OLD_STEP4
           :: !IS_BUSY(sw) && BUF_USED(lt, lh) + n > NB -> pc = P_FULL
           :: !IS_BUSY(sw) && BUF_USED(lt, lh) + n <= NB -> k = 0; pc = P_S5
#else
           :: !IS_BUSY(sw) && SLAP(sw) != LAP(PS(lt)) -> pc = P_S2L  /* consumed already */
           :: !IS_BUSY(sw) && SLAP(sw) == LAP(PS(lt)) && BUF_USED(lt, lh) + n > NB -> pc = P_FULL
           :: !IS_BUSY(sw) && SLAP(sw) == LAP(PS(lt)) && BUF_USED(lt, lh) + n <= NB ->
              k = 0; pc = P_S5
#endif
           fi;
           lh = 0;                                /* dead from here on */
           if
           :: pc != P_S4R -> sw = 0
           :: else
           fi;
           if                                     /* step 5's order: Python's or C's */
           :: pc == P_S5 && n == 2 -> if :: hl = false :: hl = true fi
           :: else
           fi }
    /* writer.py step 4: move the tails past the orphan entry (CAS from the step-2 value) */
    :: atomic { pc == P_S4R ->
           if
           :: tails == lt -> tails = PACK(PB(lt) + SLEN(sw), PS(lt) + 1); assert(HT_OK)  /* S4 */
           :: else
           fi;
           sw = 0; pc = P_S2L }                  /* continue: go to 2 */

    /* writer.py step 5: write the entry at the buffer tail, cell by cell, wrapping around the
       buffer's end: the header first (writer.py) or last (ring_send in _atomics_build.py) */
    :: atomic { pc == P_S5 ->
           if
           :: (k == 0 && !hl) || (k == n - 1 && hl) ->
              STORE_CELL(PB(lt) % NB, CELL(me, e, 0, PS(lt), n))                 /* header */
           :: else ->
              STORE_CELL((PB(lt) + k + hl) % NB, CELL(me, e, k + hl, 0, 0))      /* payload */
           fi;
           k++;
           if
           :: k == n -> k = 0; hl = false; pc = P_S6
           :: else
           fi }

    /* writer.py step 6: publish, CAS the slot from "free, this lap" to "busy, this lap, length" */
    :: atomic { pc == P_S6 -> sw = slots[PS(lt) % NS];
#ifdef BROKEN_SLOT
           if
           :: SLAP(sw) == LAP(PS(lt)) ->          /* BROKEN: a store, not a CAS from "free" */
              assert(!IS_BUSY(sw));               /* S3 */
              slots[PS(lt) % NS] = SLOT_BUSY(LAP(PS(lt)), n); pc = P_S7
           :: else -> pc = P_S6L
           fi }
#else
           if
           :: sw == SLOT_FREE(LAP(PS(lt))) ->
              assert(!IS_BUSY(sw));               /* S3 */
              slots[PS(lt) % NS] = SLOT_BUSY(LAP(PS(lt)), n); pc = P_S7
           :: else -> pc = P_S6L
           fi }
#endif
    /* writer.py step 6: the CAS failed; read the lock word: not ours, LostLock; ours: go to 2
       only if the slot is busy with another length (our bytes can never pass as its entry),
       else Unconfirmed (our entry may be handed up there; never write it twice) */
    :: atomic { pc == P_S6L ->
           if
           :: HOLDER(lock) != me -> LOST_LOCK_6
#ifdef OLD_RESEND
           :: HOLDER(lock) == me -> pc = P_S2L    /* bf44540: "look again", writes it again */
#else
           :: HOLDER(lock) == me && IS_BUSY(sw) && SLAP(sw) == LAP(PS(lt)) && SLEN(sw) != n ->
              pc = P_S2L
           :: HOLDER(lock) == me && !(IS_BUSY(sw) && SLAP(sw) == LAP(PS(lt)) && SLEN(sw) != n) ->
              e++; pc = P_S8                      /* Unconfirmed */
#endif
           fi;
           sw = 0 }

    /* writer.py step 7: move both tails with one CAS from the step-2 value */
    :: atomic { pc == P_S7 ->
           if
           :: tails == lt -> tails = PACK(PB(lt) + n, PS(lt) + 1); assert(HT_OK)   /* S4 */
           :: else                                /* a later sender repaired past us */
           fi;
           e++; pc = P_S8 }

    /* writer.py step 8: release the lock (CAS from our word to its TAINT alone; a no-op if
       taken over) */
    :: atomic { pc == P_S8 || pc == P_FULL ->
           if
           :: HOLDER(lock) == me -> lock = lock - me
           :: else
           fi;
           if
           :: pc == P_S8 -> pc = P_NEXT; n = 0    /* the next message */
           :: else -> pc = P_S1                   /* full: wait and try again */
           fi;
           lt = 0; lh = 0; sw = 0; k = 0 }
    od;
crashed:
    skip
}

active proctype receiver()
{
    byte sw;            /* the slot at the head */
    byte L;             /* its length */
    byte k;             /* cell being copied */
    short c;            /* a cell copied */
    byte w, e;          /* the writer and message id the header names */
    bool ok;            /* intact so far */

end_poll:
    do
    /* reader.py step 1: the slot at the head, busy for this lap, and the tails' entry counter
       past the head; then the lock word (ring_recv's clean: no TAINT).  (The code loads the
       slot, the tails word, then the lock word: each condition, once true, stays true until
       this receiver acts, so one step for all three loses nothing for S1-S4; for S5, reading
       the lock word later only sees TAINT more often.) */
    :: atomic { IS_BUSY(slots[PS(heads) % NS]) && LAP_OK(slots[PS(heads) % NS], PS(heads)) &&
                PASSED(PS(heads)) ->
           sw = slots[PS(heads) % NS]; L = SLEN(sw); k = 0; ok = (L <= NB);
           HOLD(lock < TAINT) };
       /* reader.py step 2: copy the entry out, cell by cell, from the buffer head, header
          first; reader.py step 3: verify it as it is copied (entry.parse: header counter and
          length match the slot, checksum over header and payload) */
       do
       :: atomic { k < L -> c = LOAD_CELL((PB(heads) + k) % NB);
              if
              :: k == 0 -> w = CW(c); e = CE(c);
                 ok = (ok && w != 0 && CK(c) == 0 && CS(c) == PS(heads) && CN(c) == L)
              :: k > 0 -> ok = (ok && c == CELL(w, e, k, 0, 0))
              fi;
              k++ }
       :: else -> break
       od;
       /* reader.py step 3: hand an intact entry up, drop any other */
       atomic {
#ifdef BROKEN_NOCHECK
           ok = true;                             /* BROKEN: no checksum, hand up anything */
#endif
           if
           :: ok ->
              assert(w >= 1 && w <= NW && e < NE && wrote[w * NE + e] == L);   /* S1 */
              assert((delivered[w] & (1 << e)) == 0);             /* S2 */
              DELIVERED(w, e)
           :: else
           fi;
           c = 0; w = 0; e = 0; ok = false };
       /* ... borrowed, it is read in place meanwhile (senders run); reader.py step 4 (or
          ring_release): clear the slot to "free, next lap" */
       atomic {
           assert(slots[PS(heads) % NS] == sw);                   /* S3: nobody overwrote it */
           slots[PS(heads) % NS] = SLOT_FREE(LAP(PS(heads) + NS));
           sw = 0; UNHOLD };
       /* reader.py step 5: advance both heads past the entry, after the slot is free */
       atomic { heads = PACK(PB(heads) + L, PS(heads) + 1); L = 0; k = 0;
                assert(HT_OK) }                                   /* S4 */
    od
}

init
{
    atomic {
        run sender(1);
        run sender(2);
        run sender(3)
    }
}
