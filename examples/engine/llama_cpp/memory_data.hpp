/**
 * @file memory_data.hpp
 * @brief A small user memory written for this project (no third-party text): the instruction
 * prefix, a short conversation, the facts extracted from it and from earlier sessions, and
 * questions about them. Used by the llama.cpp demo, its fidelity tests and the TTFT benchmark.
 */
#pragma once

#include <string>
#include <vector>

namespace inferscale::llama_cpp::demo {

/// @brief The instruction prefix the memory segment starts with (ChatML system turn).
inline std::string const instruction_prefix =
  "<|im_start|>system\nYou are a helpful assistant. The user's saved memories follow; use them "
  "to answer.\n";

/// @brief The conversation the demo tells (a newcomer reads it; the facts below come from it).
inline std::vector<std::string> const conversation = {
  "User: I finally adopted a dog last weekend, a beagle puppy. I named her Pepper.",
  "Assistant: Congratulations! How is Pepper settling in?",
  "User: Great, though she chews my running shoes. I'm training for the Lisbon half marathon in "
  "March.",
  "Assistant: Good luck with the training. Do you run alone?",
  "User: With my sister Clara on Sundays. She moved to Porto last year and works as a nurse.",
};

/// @brief One memory fact per line, each a short self-contained sentence (about 25 tokens).
/// The first five come from the conversation above; the rest from earlier sessions.
inline std::vector<std::string> const facts = {
  "Memory: The user adopted a beagle puppy named Pepper last weekend, and she chews shoes.\n",
  "Memory: The user is training for the Lisbon half marathon, which takes place in March.\n",
  "Memory: The user runs on Sundays together with her sister Clara.\n",
  "Memory: The user's sister Clara moved to Porto last year.\n",
  "Memory: The user's sister Clara works as a nurse in a hospital in Porto.\n",
  "Memory: The user works as a software engineer at a small company that builds weather apps.\n",
  "Memory: The user is allergic to peanuts and always checks restaurant menus for them.\n",
  "Memory: The user's favourite food is mushroom risotto, which she cooks every Friday.\n",
  "Memory: The user is learning to play the cello and takes a lesson every Tuesday evening.\n",
  "Memory: The user's birthday is on the fourteenth of July, and she likes small parties.\n",
  "Memory: The user drives an old green Volvo estate that she bought from her uncle.\n",
  "Memory: The user grew up in a small village near Coimbra in central Portugal.\n",
  "Memory: The user studied physics at the University of Coimbra before switching to software.\n",
  "Memory: The user's best friend is called Tomas, and he lives in Berlin with his wife.\n",
  "Memory: The user prefers tea over coffee and drinks green tea every morning.\n",
  "Memory: The user is reading a long novel about sailors and reads it before sleeping.\n",
  "Memory: The user wants to visit Japan next spring to see the cherry blossoms in Kyoto.\n",
  "Memory: The user's apartment is on the fourth floor and has a small balcony with herbs.\n",
  "Memory: The user grows basil, mint and rosemary in pots on her balcony.\n",
  "Memory: The user's father is a retired carpenter who still builds chairs in his garage.\n",
  "Memory: The user's mother teaches mathematics at a secondary school in Coimbra.\n",
  "Memory: The user has a cat named Biscuit who is twelve years old and very lazy.\n",
  "Memory: The user speaks Portuguese, English and some German, which she studies online.\n",
  "Memory: The user's favourite film is an old black and white comedy about a train journey.\n",
  "Memory: The user volunteers at an animal shelter on the first Saturday of every month.\n",
  "Memory: The user broke her left wrist while skiing two winters ago and avoids skiing now.\n",
  "Memory: The user is saving money to buy a small house with a garden outside the city.\n",
  "Memory: The user's team at work uses Python and Rust, and she prefers Rust.\n",
  "Memory: The user's manager is called Helena, and they have a meeting every Monday.\n",
  "Memory: The user likes hiking in the mountains of the Serra da Estrela in autumn.\n",
  "Memory: The user's favourite colour is dark blue, and most of her clothes are blue.\n",
  "Memory: The user goes to bed at eleven and wakes up at half past six on weekdays.\n",
  "Memory: The user's phone is three years old and its battery no longer lasts a day.\n",
  "Memory: The user plays chess online in the evenings and her rating is about fifteen hundred.\n",
  "Memory: The user does not eat red meat but eats fish and chicken a few times a week.\n",
  "Memory: The user's grandmother turned ninety this year and lives with the user's parents.\n",
  "Memory: The user takes the tram to work, and the ride takes about twenty five minutes.\n",
  "Memory: The user is afraid of flying but takes planes when she has to travel far.\n",
  "Memory: The user's favourite season is autumn because of the colours and the cool air.\n",
  "Memory: The user bakes bread at home on Sunday afternoons after her run with Clara.\n",
  "Memory: The user once lived in Edinburgh for a year as an exchange student.\n",
  "Memory: The user's neighbour is an old man named Artur who plays the accordion.\n",
  "Memory: The user wears glasses for reading and has an appointment with an optician in May.\n",
  "Memory: The user's laptop is a light silver model with a cracked corner on the lid.\n",
  "Memory: The user listens to jazz while working, especially piano trios.\n",
  "Memory: The user plans to paint the living room a pale yellow colour this summer.\n",
  "Memory: The user has never been to South America but wants to see Patagonia one day.\n",
  "Memory: The user's cousin Rui is getting married in September in a vineyard near Porto.\n",
  "Memory: The user keeps a journal and writes one page every night before reading.\n",
  "Memory: The user's favourite board game is a trading game with ships and spices.\n",
};

/// @brief Questions about the memory (ChatML user turns follow the segment).
inline std::vector<std::string> const questions = {
  "What is the name of my dog, and what breed is she?",
  "Which race am I training for, and when is it?",
  "Where does my sister live, and what does she do?",
  "What do I do on Sunday afternoons?",
};

/// @brief A question as the prompt tokens that follow the memory segment (ChatML).
inline std::string question_turn(std::string const& question)
{
  return "<|im_end|>\n<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n";
}

}  // namespace inferscale::llama_cpp::demo
