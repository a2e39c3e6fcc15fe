//! DDP's reduction overlapped with backward: each bucket all-reduced on the communication
//! thread as soon as backward has produced all of its gradients, while backward goes on.
//!
//! The buckets are DDP's ([`plan`]: reverse parameter order), and so are the buffers'
//! contents — each gradient weighted by the rank's share `n_r/B`, the three
//! [`STEP_EXTRAS`] appended to the last bucket — and the collectives, in the same order: the
//! sums are the same bits as DDP's reduction after backward. Only the moment each starts
//! changes:
//!
//! - The micro-batches before the last communicate nothing: their gradients are not
//!   complete.
//! - During the last micro-batch's backward, each parameter's gradient-ready hook marks it
//!   done; when every parameter of the next bucket is done, the bucket is filled and its
//!   all-reduce started. Buckets start strictly in order, so every rank starts the same
//!   collectives in the same order however its backward reaches the parameters.
//! - The last bucket starts when backward is over: its extras count the underflows of the
//!   whole backward. It holds the first parameters, whose gradients come last anyway.
//! - At most [`MAX_IN_FLIGHT`] buckets are under way: starting one more first waits for the
//!   oldest and writes its sums into the gradients. When backward is over every bucket is
//!   waited for in order.
//!
//! A rank holds, besides its gradients, up to [`MAX_IN_FLIGHT`] bucket buffers (DDP after
//! backward: one), the price of the overlap; `tinyllm plan` shows it, as the waits happen at
//! points fixed by the bucket order, not by timing.
//!
//! Each parameter must get its gradient from exactly one backward sweep in the last
//! micro-batch (true of a model without shared weights, checkpointed or not); a second one
//! after its bucket started would be lost, so it panics, as ZeRO-2's hooks do.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::{Rc, Weak};

use tl_tensor::Tensor;
use tl_tensor::memory::{self, Stage};

use crate::bucket::{STEP_EXTRAS, Segment, fill_bucket, plan, write_bucket};
use crate::ddp::{GradElement, StepSummary, step_extras};
use crate::link::{Pending, SharedLink};
use crate::metered::{Metered, Wire, common_owner, communication, labels};
use crate::runs::{bucket_len, ensure_grad};

/// Buckets whose all-reduce may be under way at once.
pub const MAX_IN_FLIGHT: usize = 2;

/// What [`DataParallel`](crate::DataParallel) asks of a step's overlapped reduction.
pub(crate) trait OverlappedReduction {
    /// Arms the gradient-ready hooks for the last micro-batch's backward, with this rank's
    /// weight `n_r/B`.
    fn arm(&self, weight: f64);

    /// Removes the hooks.
    fn disarm(&self);

    /// After the last backward: starts the buckets not yet started (the last with the
    /// extras), waits for every one and writes the sums into the gradients. `None` if a
    /// collective failed (the gradients are then NaN).
    fn finish(&self, weight: f64, local_loss: f64, loss_recorded: bool) -> Option<StepSummary>;
}

/// One bucket under way.
struct InFlight<E: GradElement> {
    index: usize,
    buffer: Metered<E>,
    pending: Pending<Wire<E>>,
}

/// The overlapped reduction of one step's gradients.
pub(crate) struct Overlap<E: GradElement> {
    this: Weak<RefCell<Overlap<E>>>,
    link: SharedLink,
    parameters: Vec<Tensor<E>>,
    buckets: Vec<Vec<Segment>>,
    /// Whether each parameter's gradient is complete in the last backward.
    ready: Vec<bool>,
    /// The next bucket to start.
    next: usize,
    weight: E,
    /// Whether every gradient copied so far was finite.
    finite: bool,
    /// Whether every collective waited for so far succeeded.
    ok: bool,
    meta: bool,
    in_flight: VecDeque<InFlight<E>>,
    /// Whether the step's loss was recorded (for the summary).
    loss_recorded: bool,
    summary: Option<StepSummary>,
}

impl<E: GradElement> Overlap<E> {
    /// The overlapped reduction of `parameters`' gradients over `link`, in buckets of
    /// `capacity` elements.
    pub(crate) fn new(
        link: SharedLink,
        parameters: &[Tensor<E>],
        capacity: usize,
    ) -> Rc<RefCell<Self>> {
        let numels: Vec<usize> = parameters.iter().map(Tensor::numel).collect();
        let meta = parameters.iter().any(|p| p.is_meta() || p.grad_is_meta());
        Rc::new_cyclic(|this| {
            RefCell::new(Overlap {
                this: Weak::clone(this),
                link,
                parameters: parameters.to_vec(),
                buckets: plan(&numels, capacity),
                ready: vec![false; parameters.len()],
                next: 0,
                weight: E::one(),
                finite: true,
                ok: true,
                meta,
                in_flight: VecDeque::new(),
                loss_recorded: false,
                summary: None,
            })
        })
    }

    /// Starts every bucket from `next` on whose parameters are all ready, but not the last,
    /// which waits for [`finish`](OverlappedReduction::finish).
    fn advance(&mut self) {
        while self.next + 1 < self.buckets.len()
            && self.buckets[self.next].iter().all(|s| self.ready[s.param])
        {
            self.start(self.next, None);
            self.next += 1;
        }
    }

    /// Fills bucket `index` with the weighted gradients (and, given this rank's
    /// `local_loss`, the [`STEP_EXTRAS`]) and starts its all-reduce, first completing the
    /// oldest bucket if [`MAX_IN_FLIGHT`] are under way.
    fn start(&mut self, index: usize, local_loss: Option<f64>) {
        let _reduction = memory::stage_scope(Stage::Reduction);
        if self.in_flight.len() == MAX_IN_FLIGHT {
            self.complete_oldest();
        }
        let segments = &self.buckets[index];
        let owner = common_owner(segments.iter().map(|s| &self.parameters[s.param]));
        let mut buffer = Metered::zeros(
            bucket_len(segments),
            self.meta,
            communication(labels::GRADIENT_BUCKET, owner),
        );
        if let Some(values) = buffer.values_mut() {
            self.finite &= fill_bucket(&self.parameters, segments, self.weight, values);
        }
        if let Some(local_loss) = local_loss {
            buffer.extend(step_extras::<E>(local_loss, !self.finite));
        }
        let pending = self.link.borrow_mut().start(buffer.take(), |comm, wire| {
            comm.all_reduce_sum(wire.view_mut())
        });
        self.in_flight.push_back(InFlight {
            index,
            buffer,
            pending,
        });
    }

    /// Waits for the oldest bucket under way and writes its sums into the gradients (NaN
    /// if its collective failed); for the last bucket, reads the summed extras.
    fn complete_oldest(&mut self) {
        let InFlight {
            index,
            mut buffer,
            pending,
        } = self.in_flight.pop_front().expect("a bucket is under way");
        let ok = match self.link.borrow_mut().wait(pending) {
            Some((wire, ok)) => {
                buffer.restore(wire);
                ok
            }
            None => false,
        };
        self.ok &= ok;
        let segments = &self.buckets[index];
        match (ok, buffer.values()) {
            (true, Some(values)) => write_bucket(&self.parameters, segments, values),
            // Half-reduced gradients must not reach the optimizer.
            (false, Some(_)) => segments.iter().for_each(|s| {
                let param = &self.parameters[s.param];
                ensure_grad(param);
                param.update_grad(|g| g.fill(E::nan()));
            }),
            (_, None) => segments
                .iter()
                .for_each(|s| ensure_grad(&self.parameters[s.param])),
        }
        if index + 1 == self.buckets.len() && ok {
            // A meta run sums nothing: every rank is taken to hold what this one holds.
            let summed = match buffer.values() {
                Some(values) => values[values.len() - STEP_EXTRAS..].to_vec(),
                None => step_extras::<E>(0.0, false).to_vec(),
            };
            self.summary = Some(StepSummary::of_extras(&summed, self.loss_recorded));
        }
    }
}

impl<E: GradElement> OverlappedReduction for RefCell<Overlap<E>> {
    fn arm(&self, weight: f64) {
        let mut overlap = self.borrow_mut();
        overlap.weight = E::from_f64(weight);
        for (index, param) in overlap.parameters.iter().enumerate() {
            let this = Weak::clone(&overlap.this);
            param.set_grad_ready_hook(Some(Rc::new(move || {
                if let Some(overlap) = this.upgrade() {
                    let mut overlap = overlap.borrow_mut();
                    assert!(
                        !overlap.ready[index],
                        "DDP overlap: parameter {index} got a second gradient in the last \
                         backward, after its bucket may have started (shared weights are \
                         not supported; train with --overlap=false)"
                    );
                    overlap.ready[index] = true;
                    overlap.advance();
                }
            })));
        }
    }

    fn disarm(&self) {
        for param in &self.borrow().parameters {
            param.set_grad_ready_hook(None);
        }
    }

    fn finish(&self, weight: f64, local_loss: f64, loss_recorded: bool) -> Option<StepSummary> {
        let _reduction = memory::stage_scope(Stage::Reduction);
        let mut overlap = self.borrow_mut();
        overlap.weight = E::from_f64(weight);
        let last = overlap.buckets.len() - 1;
        while overlap.next < last {
            let next = overlap.next;
            overlap.start(next, None);
            overlap.next += 1;
        }
        overlap.loss_recorded = loss_recorded;
        // With the extras: this rank's loss, whether any gradient it copied (the last
        // bucket's too) was an inf or a NaN, its underflows.
        overlap.start(last, Some(local_loss));
        overlap.next = overlap.buckets.len();
        while !overlap.in_flight.is_empty() {
            overlap.complete_oldest();
        }
        let summary = overlap.summary.take();
        summary.filter(|_| overlap.ok)
    }
}
