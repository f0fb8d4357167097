# The end-to-end scripts: the apps driven as a user does (label e2e). They run in the normal build
# only; the sanitizer build (TESSERA_BUILD_APPS OFF) covers the library through the GoogleTest
# binaries and the fuzzers, and builds no app. COST: seconds each took on two cores (2026-12-01,
# docs/testing.md), so that a fresh build, with no timing history, starts the long ones first.
function(tessera_e2e name cost)
  cmake_parse_arguments(E "" "TIMEOUT;PROCESSORS;WORKING_DIRECTORY" "COMMAND;LABELS;ENVIRONMENT"
                        ${ARGN})
  if(E_WORKING_DIRECTORY)
    add_test(NAME ${name} COMMAND ${E_COMMAND} WORKING_DIRECTORY ${E_WORKING_DIRECTORY})
  else()
    add_test(NAME ${name} COMMAND ${E_COMMAND})
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "e2e;${E_LABELS}" COST ${cost})
  foreach(p TIMEOUT PROCESSORS ENVIRONMENT)
    if(DEFINED E_${p})
      set_tests_properties(${name} PROPERTIES ${p} "${E_${p}}")
    endif()
  endforeach()
endfunction()

# The command-line contract: exit codes and one-line errors of the apps.
tessera_e2e(app.cli_errors 53 ENVIRONMENT "OMP_NUM_THREADS=1" TIMEOUT 300
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/app/test_cli.sh $<TARGET_FILE:tessera-train>
                 ${CMAKE_SOURCE_DIR}/configs)

# The data and checkpoint tools link no CUDA, NCCL or MPI (issue 58).
tessera_e2e(app.tool_links 1 TIMEOUT 60
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/app/test_tool_links.sh ${CMAKE_BINARY_DIR}/bin)

# Shipped cluster kinds from any directory, copied cluster files' rates beside them (issue 71).
tessera_e2e(app.cluster_paths 5 TIMEOUT 120
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/app/test_cluster_paths.sh ${CMAKE_BINARY_DIR}
                 ${CMAKE_SOURCE_DIR}/configs)

# The documented example commands print what the documents show (issue 71).
tessera_e2e(app.doc_examples 5 TIMEOUT 300
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/app/test_doc_examples.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR})

# tessera-plan's printed lines run the layouts it ranked (issue 71).
tessera_e2e(plan.printed_lines 30 TIMEOUT 300
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/plan/test_plan_lines.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# A Megatron-LM pretrain_gpt.sh-style launch line runs unchanged, is killed and requeues (issue 27).
tessera_e2e(app.megatron_script 27 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/app/test_megatron_script.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/data/gpt2)

# DESIGN.md invariant 2: every (TP, PP, DP, micro-batch) layout trains the single-rank model.
tessera_e2e(train.logging 29 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_logging.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR})
# Megatron's learning-rate and weight-decay schedules: logged values against the formulas, resume.
tessera_e2e(train.schedules 20 TIMEOUT 600
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_schedules.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)
# MoE with expert parallelism: saves at EP 4 resume at EP 1 / 2 / TP2 x EP2, reshard, errors.
tessera_e2e(train.moe 8 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_moe.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)
tessera_e2e(train.layout_equivalence 57 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_layout_equivalence.sh
                 $<TARGET_FILE:tessera-train> ${CMAKE_SOURCE_DIR}/configs)

# Uneven pipeline stages (issue 72): Megatron's split options and layout strings give the
# single-rank losses for odd layer counts beside every dimension and family; checkpoints resume
# across splits; bad splits refused in one line.
tessera_e2e(train.uneven_stages 20 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_uneven_stages.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# The GPU lease's manifest (issue 70): every step's programs bundled and its runner step known,
# the leases within their deadline (the first one correctness first), each lease's bundle with the
# tracked tree under the device tool's 64 MiB carry limit, sized from this build's programs; a
# lease's summary recorded, the next lease continuing after what passed.
tessera_e2e(scripts.gpu_manifest 15 TIMEOUT 120
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/test_gpu_plan.sh ${CMAKE_BINARY_DIR}/bin)

# The zero-bubble schedule (issue 72): ZB-H1's B/W split gives 1F1B's losses and gradient norms
# bit for bit beside uneven stages, VP, TP/SP, DP with the distributed optimizer, recomputation,
# MoE and MTP; W passes where the dry run says; bad combinations refused in one line.
tessera_e2e(train.zero_bubble 20 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_zero_bubble.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# The model families of issue 41 (Qwen3's per-head q/k norms, Qwen3-MoE) give the single-rank
# losses at TP+SP, PP, DP with the distributed optimizer, CP, EP and with recomputation.
tessera_e2e(train.model_families 53 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_model_families.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# Documents inside a sample (issue 40): Megatron's reset masks change the losses and give the
# single-rank ones at TP/SP, PP (interleaved), DP with the distributed optimizer, RoPE and ALiBi.
tessera_e2e(train.documents 23 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_documents.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)
# Loss masks in the shards (issue 40): the same losses at every layout, blends, Megatron's
# normalizations, bad masks refused.
tessera_e2e(train.loss_mask 23 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_loss_mask.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# Result validation and reruns (issue 39): injected errors end in Megatron's exit codes across
# relaunches (another host: a UTS namespace), report_stats trains the plain run's model, skips.
tessera_e2e(train.rerun 71 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_rerun.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)
# The hang watchdog names the stuck collective and the ranks that did not arrive; the straggler
# report toggled at run time (--disable-straggler-on-startup, --straggler-ctrlr-port).
tessera_e2e(train.hang_report 16 TIMEOUT 300 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_hang_report.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# FP8 at every layout: iteration 1 as one rank's, 20 iterations within FP8's rounding noise.
tessera_e2e(train.fp8_layouts 56 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_fp8.sh $<TARGET_FILE:tessera-train>
                 ${CMAKE_SOURCE_DIR}/configs)
tessera_e2e(train.distributed_optimizer_checkpoints 19 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_distributed_optimizer.sh
                 ${CMAKE_BINARY_DIR}/bin ${CMAKE_SOURCE_DIR}/configs)
tessera_e2e(train.context_parallel 45 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_context_parallel.sh
                 ${CMAKE_BINARY_DIR}/bin ${CMAKE_SOURCE_DIR}/configs)
tessera_e2e(app.mpi_cli 27 TIMEOUT 300 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/app/test_mpi_cli.sh $<TARGET_FILE:tessera-train>
                 ${CMAKE_SOURCE_DIR}/configs)
# Fine-tuning a Hugging Face Llama on chat data: convert, --finetune --sft, export, generate (40).
tessera_e2e(checkpoint.hf_sft 34 TIMEOUT 300
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/test_hf_sft.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR})
# Chat data (issue 40): templates against Jinja2 + Tokenizers.js, loss masks, tessera-inspect.
tessera_e2e(data.chat 26 TIMEOUT 300
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/data/test_chat.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR})
# Megatron's data blends through tessera-inspect and tessera-train (issue 28).
tessera_e2e(data.blend 38 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/data/test_blend.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR}/data/gpt2
                 ${CMAKE_SOURCE_DIR}/data/hf-tokenizers)
# Hugging Face tokenizer.json through tessera-preprocess and tessera-generate (ids == Tokenizers.js).
tessera_e2e(data.hf_tokenizer_tools 27 TIMEOUT 600
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/data/test_hf_tools.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR})
tessera_e2e(data.megatron_import 6 TIMEOUT 600
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/data/test_megatron_import.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR}/data/gpt2)
# Shards from other tools (h5py defaults), token ids outside the vocabulary, bad attributes.
tessera_e2e(data.foreign_shards 10 TIMEOUT 600
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/data/test_foreign_shards.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)
tessera_e2e(checkpoint.end_to_end 30 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/test_checkpoint.sh
                 ${CMAKE_BINARY_DIR}/bin ${CMAKE_SOURCE_DIR}/configs)
# Read-only use, --async-save (failures, a full disk, SIGTERM), and kill -9 during saves (labelled
# faults: timing-driven, left out of the sanitizer pass like the Slurm test).
tessera_e2e(checkpoint.hardening 64 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/test_hardening.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR}/data/gpt2 main)
tessera_e2e(checkpoint.kill_faults 118 TIMEOUT 900 PROCESSORS 2 LABELS faults
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/test_hardening.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR}/data/gpt2 kills)
tessera_e2e(checkpoint.hf_llama 107 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/test_hf_llama.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR})
# Hugging Face DeepSeek-V3 (issue 41): byte-identical round trips with the expert biases and the
# MTP layer, greedy against an independent float64 forward, the biases through training.
tessera_e2e(checkpoint.hf_deepseek 24 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/test_hf_deepseek.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR})
tessera_e2e(inference.generate_and_eval 62 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/inference/test_generate.sh
                 ${CMAKE_BINARY_DIR}/bin ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR}/data/gpt2)
tessera_e2e(inference.serve 35 TIMEOUT 900 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/inference/test_serve.sh
                 ${CMAKE_BINARY_DIR}/bin ${CMAKE_SOURCE_DIR}/configs ${CMAKE_SOURCE_DIR}/data/gpt2)
tessera_e2e(scripts.plot_metrics 1
            COMMAND bash -c "printf '%s\\n' '{\"iteration\": 1, \"consumed_samples\": 8, \"lm_loss\": 6.1, \"lr\": 0.001, \"grad_norm\": 1, \"ms_per_iter\": 5, \"tokens_per_s\": 900, \"gflops_per_s_per_rank\": 1}' '{\"iteration\": 2, \"consumed_samples\": 16, \"lm_loss\": 5.2, \"lr\": 0.002, \"grad_norm\": 1, \"ms_per_iter\": 5, \"tokens_per_s\": 950, \"gflops_per_s_per_rank\": 1}' '{\"iteration\": 2, \"valid_lm_loss\": 5.5}' > m.jsonl && ${CMAKE_SOURCE_DIR}/scripts/plot-metrics plot.png m.jsonl m.jsonl && head -c 8 plot.png | od -An -c | grep -q 'P   N   G' && ! ${CMAKE_SOURCE_DIR}/scripts/plot-metrics bad.png /nonexistent.jsonl"
         WORKING_DIRECTORY ${CMAKE_BINARY_DIR})

# The shipped Slurm scripts on a real single-node Slurm started by the test (installs slurm-wlm
# and munge when missing; needs root for that).
tessera_e2e(slurm.end_to_end 207 TIMEOUT 900 LABELS slurm
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/slurm/test_slurm.sh ${CMAKE_SOURCE_DIR})

# The step-time predictor's collective plan equals each rank's recorded collectives of a real MPI
# run, for TP/SP, PP (1F1B, interleaved), DP (buckets, distributed optimizer), CP, recomputation,
# EP and q/k norms (issue 57).
tessera_e2e(plan.collective_sequence 12 TIMEOUT 300 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/plan/test_collective_sequence.sh
                 ${CMAKE_BINARY_DIR}/bin ${CMAKE_SOURCE_DIR}/configs)

# Muon (issue 59): the single-rank trajectory at TP2 (+SP, duplicated and distributed), PP2, DP2,
# TP2 x PP2; blockwise differs; GQA without the q/k/v split; momentum resumed across layouts.
tessera_e2e(train.muon 12 TIMEOUT 300 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_muon.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)

# Megatron-FSDP (issue 59): every sharding strategy at DP2 and DP4, and with TP + SP, PP (1F1B,
# interleaved), CP, full recomputation, EP and Muon, gives the 1-rank trajectory; checkpoints
# move between FSDP and TP x PP; the pool the run holds is the --dry-run estimate's.
tessera_e2e(train.fsdp 60 TIMEOUT 600 PROCESSORS 2
            COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/train/test_fsdp.sh ${CMAKE_BINARY_DIR}/bin
                 ${CMAKE_SOURCE_DIR}/configs)
