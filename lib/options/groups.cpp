// groups.cpp: the one list of tessera-train's option groups, in --help's order. A new group is a
// file in this folder (a class implementing OptionGroup and its make_ function) and a line here.
#include "options/option_group.hpp"

namespace tessera {

std::unique_ptr<OptionGroup> make_model_options();        // model.cpp
std::unique_ptr<OptionGroup> make_moe_options();          // moe.cpp
std::unique_ptr<OptionGroup> make_parallelism_options();  // parallelism.cpp
std::unique_ptr<OptionGroup> make_training_options();     // training.cpp
std::unique_ptr<OptionGroup> make_optimizer_options();    // optimizer.cpp
std::unique_ptr<OptionGroup> make_memory_options();       // memory.cpp
std::unique_ptr<OptionGroup> make_data_options();         // data.cpp
std::unique_ptr<OptionGroup> make_document_options();     // documents.cpp
std::unique_ptr<OptionGroup> make_checkpoint_options();   // checkpoint.cpp
std::unique_ptr<OptionGroup> make_validation_options();   // validation.cpp
std::unique_ptr<OptionGroup> make_logging_options();      // logging.cpp
std::unique_ptr<OptionGroup> make_kernel_options();       // kernels.cpp
std::unique_ptr<OptionGroup> make_fp8_options();          // fp8.cpp
std::unique_ptr<OptionGroup> make_planning_options();     // planning.cpp
std::unique_ptr<OptionGroup> make_accepted_options();     // accepted.cpp

std::vector<std::unique_ptr<OptionGroup>> make_option_groups() {
  std::vector<std::unique_ptr<OptionGroup>> groups;
  groups.push_back(make_model_options());
  groups.push_back(make_moe_options());
  groups.push_back(make_parallelism_options());
  groups.push_back(make_training_options());
  groups.push_back(make_optimizer_options());
  groups.push_back(make_memory_options());
  groups.push_back(make_data_options());
  groups.push_back(make_document_options());
  groups.push_back(make_checkpoint_options());
  groups.push_back(make_validation_options());
  groups.push_back(make_logging_options());
  groups.push_back(make_kernel_options());
  groups.push_back(make_fp8_options());
  groups.push_back(make_planning_options());
  groups.push_back(make_accepted_options());
  return groups;
}

}  // namespace tessera
