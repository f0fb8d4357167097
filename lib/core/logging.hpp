// logging.hpp: Boost.Log with severity, a rank prefix and an optional file sink.
#pragma once

#include <boost/log/sources/record_ostream.hpp>
#include <boost/log/sources/severity_logger.hpp>
#include <string>

namespace tessera {

enum class LogLevel { debug, info, warning, error };

struct LogOptions {
  int rank = 0;
  std::string host;  // shown in error lines
  LogLevel level = LogLevel::info;
  bool all_ranks = false;  // false: only rank 0 prints info and below to the console
  std::string file;        // optional: every record of this rank also goes here
};

// Sets up the sinks; safe to call again (replaces the previous set-up).
void init_logging(const LogOptions& opts);
LogLevel log_level_from_name(const std::string& name);  // throws ConfigError

boost::log::sources::severity_logger_mt<LogLevel>& logger();
const LogOptions& log_options();

}  // namespace tessera

#define TLOG(lvl) BOOST_LOG_SEV(::tessera::logger(), ::tessera::LogLevel::lvl)
