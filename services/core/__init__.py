"""core: the pure domain every service, the simulator and the tools share (no I/O
beyond reading the JSON files shipped in this package).

* `perf`: Aladdin's (§3) and CaraServe's (§5) performance models and their online fit;
* `queue_order`: the queue orders (FCFS, priority, speculative SJF with aging, oracle)
  and head-of-line admission a worker and the simulator apply;
* `size_rule`: speculative SJF's size rule (`SizeRule`: window, overtake bound, tail guard) and its
  refinement (`RemainingEstimator`, `Preemptor`), re-exported by `queue_order`;
* `profile_fit`: fitting Aladdin's models to Splitwise measurements (writes a profile);
* `profiles`: the shipped engine profiles (`profiles/*.json`) and the one lookup of them;
* `encoder_text`: encoder checkpoints and their tokenizer, without torch;
* `names`: the single vocabularies of dispatch-policy and scaler names.

Services talk to each other only over NATS; what they share as code lives here.
"""
