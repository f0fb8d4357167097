// error.cpp: formatting of check failures.
#include "core/error.hpp"

namespace tessera {

void throw_check_failure(const char* expr, const char* file, int line, const std::string& detail) {
  std::ostringstream os;
  os << detail << " (" << expr << " failed at " << file << ":" << line << ")";
  throw Error(os.str());
}

}  // namespace tessera
